//! The f64 CPU reference (being written).
