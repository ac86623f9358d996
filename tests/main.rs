//! All integration tests in one binary (one link on a 2-core machine).

mod audit;
mod cli;
mod clippers;
mod common;
mod detection;
mod layout;
mod model;
mod privacy;
mod properties;
mod traces;
