"""Static graph capture per (B, K) bucket."""

from funcspec.capture import cache, store

from funcspec.capture.backends import (
    BACKENDS,
    Captured,
    CaptureStats,
    DonatedLeaf,
    Donation,
    capture,
    declare_donation,
    fresh_code_copy,
    resolve_backend,
)
from funcspec.capture.buckets import CAPTURE_MODES, STARTUP_SAMPLING, BucketPlan, default_batch_buckets

__all__ = [
    "BACKENDS",
    "BucketPlan",
    "CAPTURE_MODES",
    "STARTUP_SAMPLING",
    "cache",
    "store",
    "Captured",
    "CaptureStats",
    "DonatedLeaf",
    "Donation",
    "capture",
    "declare_donation",
    "default_batch_buckets",
    "fresh_code_copy",
    "resolve_backend",
]
