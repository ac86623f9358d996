//! All integration tests in one binary (one link on a 2-core machine).

mod accountant;
mod audit;
mod cli;
mod clippers;
mod common;
mod deferred;
mod deprecated_flags;
mod detection;
mod files;
mod judge;
mod layout;
mod model;
mod peer;
mod precision;
mod privacy;
mod properties;
mod report;
mod rounding;
mod rows;
mod step;
mod stored_factors;
mod traces;
