//! docs: to come.
