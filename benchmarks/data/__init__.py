"""Data-stage benchmarks: loader throughput, loader integrity across workers, frozen-tower precompute and
evaluation speed."""
