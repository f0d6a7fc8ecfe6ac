//! CUDA C++ emission (being written).
