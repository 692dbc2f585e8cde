// The CPU implementations of the kernels' torch operators: funcspec::stream_linear, funcspec::qlinear and
// funcspec::decode_attention (their schemas and trace-time Meta functions are registered from Python:
// stream.py, quant.py, attention.py).
//
// A decode step calls these 20-70 times. Implemented in Python, each call cost several microseconds beyond
// its kernel (the dispatcher's way into Python, the checks, ctypes), about as much as a small model's
// product itself. Here each call checks its operands (the kernels read raw memory: a wrong dtype or shape is
// a ValueError naming it, never a read out of bounds), allocates its output and calls the kernel library
// that build.py chose for this CPU, whose functions funcspec_ops_bind points the operators at.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>

namespace {

// The C ABI of the kernel library (build.py's _SIGNATURES), by dtype: [0] bf16, [1] fp32.
using LinearFn = void (*)(const void*, const void*, const void*, void*, int64_t, int64_t, int64_t, int);
using QlinearFn = void (*)(const void*, const void*, const void*, const void*, const void*, void*, int64_t,
                           int64_t, int64_t, int64_t, int, int);
using AttendFn = void (*)(const void*, const void*, const void*, const void*, void*, int64_t, int64_t, int64_t,
                          int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t,
                          int64_t, int64_t, float, int);

struct Kernels {
  LinearFn linear[2] = {nullptr, nullptr};
  QlinearFn qlinear[2] = {nullptr, nullptr};
  AttendFn attend[2] = {nullptr, nullptr};
};
Kernels bound;  // set by funcspec_ops_bind; null: the kernels are not (or no longer) chosen

constexpr int64_t BLOCK = 64;  // outputs per column block of stream_linear's packed weight (stream.cpp)
constexpr int64_t QB = 32;     // outputs per column block of qlinear's packed weight (quant.cpp)
constexpr int64_t AB = 32;     // k per activation block of qlinear
constexpr int64_t MAX_HEAD_DIM = 256;

// Calls of less work run on one thread, where waking the pool costs more than a second thread saves
// (graphs/results/notes/kernels.md): products of fewer multiply-adds, quantized products of fewer weights (and
// multiply-adds), attentions of fewer multiply-adds over the whole cache read.
constexpr int64_t SERIAL_STREAM_MACS = 1 << 15;
constexpr int64_t SERIAL_QUANT_WEIGHTS = 1 << 17;
constexpr int64_t SERIAL_QUANT_MACS = 1 << 20;
constexpr int64_t SERIAL_ATTEND_MACS = 1 << 17;

// torch's Python name of a dtype, as the messages of the Python checks these replaced wrote it.
std::string dtype_name(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return "torch.float32";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kHalf: return "torch.float16";
    case at::kDouble: return "torch.float64";
    case at::kLong: return "torch.int64";
    case at::kInt: return "torch.int32";
    case at::kShort: return "torch.int16";
    case at::kChar: return "torch.int8";
    case at::kByte: return "torch.uint8";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

bool streamable(const at::Tensor& t) { return t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kFloat; }

int which(const at::Tensor& x) { return x.scalar_type() == at::kBFloat16 ? 0 : 1; }

template <class Fn>
Fn kernel(Fn fn) {
  TORCH_CHECK(fn != nullptr, "funcspec: a CPU kernel was called where the kernels are unavailable or turned off");
  return fn;
}

int threads(bool serial) { return serial ? 1 : at::get_num_threads(); }

// [..., n] of x's leading sizes.
at::Tensor output(const at::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return at::empty(sizes, x.options());
}

const void* ptr(const std::optional<at::Tensor>& t) { return t.has_value() ? t->data_ptr() : nullptr; }

// bias, if any, in x's dtype and contiguous.
std::optional<at::Tensor> like_x(const std::optional<at::Tensor>& bias, const at::Tensor& x) {
  if (!bias.has_value()) return bias;
  return bias->to(x.scalar_type()).contiguous();
}

void check_bias(const char* op, const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK_VALUE(!bias.has_value() || (bias->dim() == 1 && bias->size(0) == n), op, ": bias must be [", n,
                    "], got ", bias.has_value() ? bias->sizes() : at::IntArrayRef());
}

// x @ W.T (+ b) [..., n] for x [..., K] and W packed by stream.pack_weight.
at::Tensor stream_linear(const at::Tensor& x_, const at::Tensor& packed, const std::optional<at::Tensor>& bias_,
                         int64_t n) {
  TORCH_CHECK_VALUE(streamable(x_) && packed.scalar_type() == x_.scalar_type(),
                    "stream_linear: x and the packed weight must both be bfloat16 or float32, got x ",
                    dtype_name(x_.scalar_type()), " and weight ", dtype_name(packed.scalar_type()));
  TORCH_CHECK_VALUE(x_.dim() >= 1, "stream_linear: x must be [..., in], got ", x_.sizes());
  const int64_t pair = x_.scalar_type() == at::kBFloat16 ? 2 : 1;
  const int64_t k = x_.size(-1) + x_.size(-1) % pair;  // bf16 reads k in pairs: an odd K gains a zero
  TORCH_CHECK_VALUE(packed.dim() == 4 && packed.is_contiguous() && packed.size(1) * pair == k &&
                        packed.size(2) == BLOCK && packed.size(3) == pair && 0 < n && n <= packed.size(0) * BLOCK,
                    "stream_linear: the packed weight must be [N'/64, ", k / pair, ", 64, ", pair, "] for x [..., ",
                    x_.size(-1), "] and ", n, " outputs (pack_weight), got ", packed.sizes());
  check_bias("stream_linear", bias_, n);
  at::Tensor x = x_.size(-1) != k ? at::constant_pad_nd(x_, {0, 1}) : x_;  // [..., K']
  x = x.contiguous();
  const auto bias = like_x(bias_, x);
  at::Tensor out = output(x, n);  // [..., n]
  const int64_t rows = c10::multiply_integers(x.sizes().begin(), x.sizes().end() - 1);
  kernel(bound.linear[which(x)])(x.data_ptr(), packed.data_ptr(), ptr(bias), out.data_ptr(), rows, n, k,
                                 threads(rows * n * k < SERIAL_STREAM_MACS));
  return out;
}

// x @ W.T (+ b) [..., n] for x [..., k] and a quantized W (quant.pack's qweight, scales, offsets?).
at::Tensor qlinear(const at::Tensor& x_, const at::Tensor& qweight, const at::Tensor& scales,
                   const std::optional<at::Tensor>& offsets, const std::optional<at::Tensor>& bias_, int64_t n,
                   int64_t k, int64_t bits, int64_t group) {
  TORCH_CHECK_VALUE((bits == 4 || bits == 6 || bits == 8) && n > 0 && k > 0 && group > 0 && k % AB == 0 &&
                        k % group == 0 && (group % AB == 0 || (bits != 4 && group == 16)),
                    "qlinear: a ", bits, "-bit weight [", n, ", ", k, "] in groups of ", group,
                    " is not one the kernel holds (8, 6 or 4 bits; in_features a multiple of 32, the group size a "
                    "multiple of 32 dividing it, or 16 at 8 and 6 bits)");
  TORCH_CHECK_VALUE(bits != 6 || !offsets.has_value(), "qlinear: 6-bit weights are symmetric, got offsets");
  const int64_t steps = k * bits / 32, blocks = (n + QB - 1) / QB;
  const std::string fmt = c10::str(bits, "-bit [", n, ", ", k, "] in groups of ", group);
  TORCH_CHECK_VALUE(streamable(x_) && x_.dim() >= 1 && x_.size(-1) == k, "qlinear: x must be bfloat16 or float32 [..., ",
                    k, "], got ", dtype_name(x_.scalar_type()), " ", x_.sizes());
  TORCH_CHECK_VALUE(qweight.scalar_type() == at::kByte && qweight.sizes() == at::IntArrayRef({blocks, steps, QB, 4}),
                    "qlinear: qweight must be uint8 [", blocks, ", ", steps, ", ", QB, ", 4] for ", fmt, ", got ",
                    dtype_name(qweight.scalar_type()), " ", qweight.sizes());
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"scales", &scales},
                                {"offsets", offsets.has_value() ? &*offsets : nullptr}}) {
    if (t == nullptr) continue;
    TORCH_CHECK_VALUE(t->scalar_type() == at::kHalf && t->sizes() == at::IntArrayRef({blocks, k / group, QB}),
                      "qlinear: ", name, " must be float16 [", blocks, ", ", k / group, ", ", QB, "], got ",
                      dtype_name(t->scalar_type()), " ", t->sizes());
  }
  check_bias("qlinear", bias_, n);
  const at::Tensor x = x_.contiguous(), q = qweight.contiguous(), s = scales.contiguous();
  const std::optional<at::Tensor> o = offsets.has_value() ? std::optional<at::Tensor>(offsets->contiguous()) : offsets;
  const auto bias = like_x(bias_, x);
  at::Tensor out = output(x, n);  // [..., n]
  const int64_t rows = x.numel() / k;
  const bool serial = n * k < SERIAL_QUANT_WEIGHTS && rows * n * k < SERIAL_QUANT_MACS;
  kernel(bound.qlinear[which(x)])(x.data_ptr(), q.data_ptr(), s.data_ptr(), ptr(o), ptr(bias), out.data_ptr(), rows,
                                  n, k, group, (int)bits, threads(serial));
  return out;
}

// softmax(q k^T / sqrt(D)) v [B, T, H·D] of q [B, T, H, D] over keys/vals [B, H_kv, T_read, D] where visible.
at::Tensor decode_attention(const at::Tensor& q_, const at::Tensor& keys_, const at::Tensor& vals_,
                            const at::Tensor& visible_) {
  TORCH_CHECK_VALUE(streamable(q_) && keys_.scalar_type() == q_.scalar_type() &&
                        vals_.scalar_type() == q_.scalar_type(),
                    "decode_attention: q, keys and vals must all be bfloat16 or float32, got ",
                    dtype_name(q_.scalar_type()), ", ", dtype_name(keys_.scalar_type()), " and ",
                    dtype_name(vals_.scalar_type()));
  TORCH_CHECK_VALUE(q_.dim() == 4 && 1 <= q_.size(3) && q_.size(3) <= MAX_HEAD_DIM,
                    "decode_attention: q must be [B, T, H, D] with the head size D in 1..", MAX_HEAD_DIM, ", got ",
                    q_.sizes());
  const int64_t b = q_.size(0), t = q_.size(1), h = q_.size(2), d = q_.size(3);
  // NOTE: H_kv >= 1 before h % H_kv: an integer division by zero would not say which operand is wrong.
  TORCH_CHECK_VALUE(keys_.dim() == 4 && keys_.sizes() == vals_.sizes() && keys_.size(0) == b && keys_.size(3) == d &&
                        keys_.size(1) >= 1 && h % keys_.size(1) == 0,
                    "decode_attention: keys and vals must be [", b, ", H_kv, T_read, ", d, "] with H_kv dividing ", h,
                    ", got ", keys_.sizes(), " and ", vals_.sizes());
  const int64_t hkv = keys_.size(1), tr = keys_.size(2);
  TORCH_CHECK_VALUE(visible_.scalar_type() == at::kBool && visible_.sizes() == at::IntArrayRef({b, t, tr}),
                    "decode_attention: visible must be bool [", b, ", ", t, ", ", tr, "], got ",
                    dtype_name(visible_.scalar_type()), " ", visible_.sizes());
  const at::Tensor visible = visible_.contiguous();
  // q, K and V are read in place at their strides (q: a view of the fused q/k/v product; K, V: the cache's slot,
  // head and token); only a row of D must be contiguous
  const at::Tensor q = q_.stride(3) == 1 ? q_ : q_.contiguous();
  const at::Tensor keys = keys_.stride(3) == 1 ? keys_ : keys_.contiguous();
  const at::Tensor vals = vals_.stride(3) == 1 ? vals_ : vals_.contiguous();
  at::Tensor out = at::empty({b, t, h * d}, q.options());  // [B, T, H·D]
  const float scale = (float)std::pow((double)d, -0.5);
  kernel(bound.attend[which(q)])(q.data_ptr(), keys.data_ptr(), vals.data_ptr(), visible.data_ptr(), out.data_ptr(),
                                 b, t, h, hkv, d, tr, keys.stride(0), keys.stride(1), keys.stride(2), vals.stride(0),
                                 vals.stride(1), vals.stride(2), q.stride(0), q.stride(1), q.stride(2), scale,
                                 threads(b * t * h * tr * d < SERIAL_ATTEND_MACS));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(funcspec, CPU, m) {
  m.impl("stream_linear", stream_linear);
  m.impl("qlinear", qlinear);
  m.impl("decode_attention", decode_attention);
}

extern "C" {

// Point the operators at a kernel library's functions (bf16, fp32 of each); nulls unbind them.
void funcspec_ops_bind(void* linear_bf16, void* linear_f32, void* qlinear_bf16, void* qlinear_f32,
                       void* attend_bf16, void* attend_f32) {
  bound.linear[0] = reinterpret_cast<LinearFn>(linear_bf16);
  bound.linear[1] = reinterpret_cast<LinearFn>(linear_f32);
  bound.qlinear[0] = reinterpret_cast<QlinearFn>(qlinear_bf16);
  bound.qlinear[1] = reinterpret_cast<QlinearFn>(qlinear_f32);
  bound.attend[0] = reinterpret_cast<AttendFn>(attend_bf16);
  bound.attend[1] = reinterpret_cast<AttendFn>(attend_f32);
}
}
