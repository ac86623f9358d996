//! Every clipper ghost-oracle can run, by name: one table of the built-in clippers, and the
//! seeded bugs of [`Mutant::ALL`] as `mutant:NAME`. The CLI, the Python package and the kill
//! matrix all look clippers up here.

use crate::clippers::{Clipper, GhostClipper, MaterializeClipper, TiedGhostClipper};
use crate::error::{Error, Result};
use crate::mutants::{Mutant, MutantClipper};

/// A built-in clipper: its name and how to make one.
pub struct ClipperEntry {
    /// The name the CLI and reports know it by.
    pub name: &'static str,
    /// Makes a fresh clipper.
    pub make: fn() -> Box<dyn Clipper>,
    /// A correct clipper: the kill matrix requires that it is never flagged.
    pub correct: bool,
}

/// The built-in clippers, in the order audits list them.
pub const BUILTIN: &[ClipperEntry] = &[
    ClipperEntry {
        name: MaterializeClipper::NAME,
        make: || Box::new(MaterializeClipper),
        correct: true,
    },
    ClipperEntry {
        name: GhostClipper::NAME,
        make: || Box::new(GhostClipper),
        correct: false,
    },
    ClipperEntry {
        name: TiedGhostClipper::NAME,
        make: || Box::new(TiedGhostClipper),
        correct: true,
    },
];

/// The names of the built-in clippers.
pub fn builtin_names() -> Vec<&'static str> {
    BUILTIN.iter().map(|e| e.name).collect()
}

/// A clipper by name: a built-in one, or `mutant:NAME` for a seeded bug.
pub fn clipper(name: &str) -> Result<Box<dyn Clipper>> {
    if let Some(e) = BUILTIN.iter().find(|e| e.name == name) {
        return Ok((e.make)());
    }
    match name.strip_prefix("mutant:").map(Mutant::parse) {
        Some(Some(m)) => Ok(Box::new(MutantClipper(m))),
        Some(None) | None => Err(Error::input(format!(
            "unknown clipper `{name}`; expected one of: {}, or mutant:NAME for a seeded bug ({})",
            builtin_names().join(", "),
            Mutant::ALL
                .iter()
                .map(|m| m.name())
                .collect::<Vec<_>>()
                .join(", ")
        ))),
    }
}

/// The clippers of a list of names, or every built-in clipper when the list is empty.
pub fn clippers(names: &[String]) -> Result<Vec<Box<dyn Clipper>>> {
    if names.is_empty() {
        Ok(BUILTIN.iter().map(|e| (e.make)()).collect())
    } else {
        names.iter().map(|n| clipper(n)).collect()
    }
}

/// The kill matrix's rows: every seeded bug, then the correct built-in clippers.
pub fn kill_matrix_clippers() -> Vec<(Option<Mutant>, Box<dyn Clipper>)> {
    let mutants = Mutant::ALL
        .iter()
        .map(|&m| (Some(m), Box::new(MutantClipper(m)) as Box<dyn Clipper>));
    let correct = BUILTIN
        .iter()
        .rev()
        .filter(|e| e.correct)
        .map(|e| (None, (e.make)()));
    mutants.chain(correct).collect()
}
