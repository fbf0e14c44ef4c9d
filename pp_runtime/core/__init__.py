"""The torch-free data path: requests, micro-batches, the driver loop, workloads, errors."""
