from funcspec.train import main

main()
