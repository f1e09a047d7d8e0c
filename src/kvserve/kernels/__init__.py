"""Native CPU kernels (C++ with run-time ISA dispatch) and their pure-torch twins; see `ops.Kernels`."""
