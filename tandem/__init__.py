"""What stands above every package: the `tandem` command, the local-cluster launcher, the
configuration reference and the process helpers that tests and benchmarks share. Nothing below
imports it."""
