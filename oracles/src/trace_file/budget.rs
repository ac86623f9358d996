//! How much memory reading and judging one trace may take. A trace comes from other people's
//! code: its header says how large its sites are, and a few bytes of header can describe
//! gigabytes of gradient. Instead of a fixed cap on every site (which the embeddings of the
//! models people fine-tune exceed: Llama-3.2-1B's is 262.7 M entries), the reader adds up what
//! the file would make it hold, before holding any of it, and refuses past a budget: by default
//! the memory the machine has available, else what `--max-memory` (`max_memory=`) says.

use crate::error::{bail, Result};
use crate::tensors::RELEASE_ALIGN;
use std::fmt;

/// Bytes of one example set's per-example gradient rows a judge holds at once while it streams a
/// parameter's gradient (a tied embedding and head, V×d per example, is never held whole):
/// rows are taken in blocks of about this size, all examples of the batch together.
pub const GRADIENT_BLOCK_BYTES: usize = 64 << 20;

/// Used when the machine's memory cannot be read (no `/proc/meminfo`).
const FALLBACK_BYTES: u64 = 4 << 30;

/// Where a budget's figure came from, said in a refusal so the user knows what to change.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Source {
    /// `MemAvailable` (else `MemTotal`) in /proc/meminfo.
    Machine(&'static str),
    /// Neither could be read.
    Fallback,
    /// The user's `--max-memory` / `max_memory=`.
    Given,
}

/// The most bytes a trace may make the reader and the judge hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemoryBudget {
    bytes: u64,
    source: Source,
}

impl MemoryBudget {
    /// A budget of `bytes`, as the user gave it.
    pub fn bytes(bytes: u64) -> Self {
        MemoryBudget {
            bytes,
            source: Source::Given,
        }
    }

    /// The machine's available memory (`MemAvailable` in /proc/meminfo, else `MemTotal`), else
    /// 4 GiB where neither can be read.
    pub fn machine() -> Self {
        let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        for key in ["MemAvailable", "MemTotal"] {
            if let Some(kib) = meminfo_kib(&text, key) {
                return MemoryBudget {
                    bytes: kib.saturating_mul(1024),
                    source: Source::Machine(key),
                };
            }
        }
        MemoryBudget {
            bytes: FALLBACK_BYTES,
            source: Source::Fallback,
        }
    }

    /// A human size: a number of bytes, or a number with a binary unit K, M, G or T (an optional
    /// trailing `B` or `iB`; `1.5G`, `512M`, `8GiB`). `what` names the flag or argument.
    pub fn parse(text: &str, what: &str) -> Result<Self> {
        let t = text.trim();
        let lower = t.to_ascii_lowercase();
        let lower = lower
            .strip_suffix("ib")
            .or_else(|| lower.strip_suffix('b'))
            .unwrap_or(&lower);
        let (number, shift) = match lower.chars().last() {
            Some('k') => (&lower[..lower.len() - 1], 10),
            Some('m') => (&lower[..lower.len() - 1], 20),
            Some('g') => (&lower[..lower.len() - 1], 30),
            Some('t') => (&lower[..lower.len() - 1], 40),
            _ => (lower, 0),
        };
        let value: f64 = match number.trim().parse::<f64>() {
            Ok(v) if v.is_finite() && v > 0.0 => v,
            _ => bail!(
                "{what}: expected a positive size such as 8G, 512M or 1073741824 (bytes), found `{text}`"
            ),
        };
        let bytes = value * (1u64 << shift) as f64;
        if bytes < 1.0 || bytes >= u64::MAX as f64 {
            bail!("{what}: `{text}` is not a size in 1 byte..16 EiB");
        }
        Ok(MemoryBudget::bytes(bytes as u64))
    }

    /// The budget in bytes.
    pub fn get(self) -> u64 {
        self.bytes
    }
}

impl fmt::Display for MemoryBudget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let size = Size(self.bytes);
        match self.source {
            Source::Given => write!(f, "{size} (--max-memory / max_memory=)"),
            Source::Machine(key) => write!(
                f,
                "{size} ({key} in /proc/meminfo; --max-memory / max_memory= sets another)"
            ),
            Source::Fallback => write!(
                f,
                "{size} (the machine's memory could not be read; --max-memory / max_memory= sets another)"
            ),
        }
    }
}

/// A number of bytes for people: `1.50 GiB`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Size(pub u64);

impl fmt::Display for Size {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0 as f64;
        for (unit, shift) in [("TiB", 40), ("GiB", 30), ("MiB", 20), ("KiB", 10)] {
            let scale = (1u64 << shift) as f64;
            if b >= scale {
                return write!(f, "{:.2} {unit}", b / scale);
            }
        }
        write!(f, "{} bytes", self.0)
    }
}

fn meminfo_kib(text: &str, key: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let rest = line.strip_prefix(key)?.strip_prefix(':')?;
        let value = rest.trim().strip_suffix("kB").unwrap_or(rest).trim();
        value.parse().ok()
    })
}

/// A running sum of what a trace would make the reader and the judge hold, refused as soon as it
/// passes the budget, naming what passed it.
pub(crate) struct Tally<'a> {
    budget: MemoryBudget,
    total: u64,
    label: &'a str,
}

impl<'a> Tally<'a> {
    pub(crate) fn new(budget: MemoryBudget, label: &'a str) -> Self {
        Tally {
            budget,
            total: 0,
            label,
        }
    }

    /// Adds `bytes` for `what` (a tensor, a site, a parameter, said in the refusal).
    pub(crate) fn add(&mut self, bytes: u64, what: impl FnOnce() -> String) -> Result<()> {
        self.total = self.total.saturating_add(bytes);
        if self.total > self.budget.bytes {
            bail!(
                "{}: {} needs {}, bringing what reading and judging this trace holds to {}; the memory budget is {}",
                self.label,
                what(),
                Size(bytes),
                Size(self.total),
                self.budget
            );
        }
        Ok(())
    }

    /// Adds what a memory-mapped trace of `file_len` bytes whose header (its length field
    /// included) is `header` bytes holds of its own file, before the header is parsed: the
    /// header, or the whole file where it is no longer than the header and one 64 KiB span
    /// (what [`Tally::add_mapped_tensors`] would bring it to whatever the tensors). Returns
    /// whether the whole file was counted.
    pub(crate) fn add_mapped_header(&mut self, file_len: u64, header: u64) -> Result<bool> {
        if file_len <= header.saturating_add(RELEASE_ALIGN as u64) {
            self.add(file_len, || "the file (held while it is read)".into())?;
            return Ok(true);
        }
        self.add(header, || {
            "the file's header (parsed before any tensor is read)".into()
        })?;
        Ok(false)
    }

    /// Adds the rest of what a memory-mapped trace holds of its own file while it is read, after
    /// [`Tally::add_mapped_header`] counted its header. Not the whole file: the reader copies or
    /// widens one tensor at a time and releases its pages as soon as it has
    /// ([`crate::tensors::release_pages`]), so at most one tensor's bytes are resident at once
    /// (the `largest`'s bound them), with, at each of the file's `tensors`' two ends, the part of
    /// a 64 KiB span it shares with its neighbour, which a release leaves in place (and the
    /// kernel's fault-around, 64 KiB by default, may map). Never more than the file. The widened
    /// factors and the copies are counted apart, as for a file held whole.
    pub(crate) fn add_mapped_tensors(
        &mut self,
        file_len: u64,
        header: u64,
        largest: Option<(usize, &str)>,
        tensors: usize,
    ) -> Result<()> {
        let ends = (RELEASE_ALIGN as u64).saturating_mul(2 * tensors as u64 + 1);
        let (bytes, name) = largest.unwrap_or((0, ""));
        let resident = (bytes as u64)
            .saturating_add(ends)
            .min(file_len.saturating_sub(header));
        self.add(resident, || {
            format!("the file's largest tensor `{name}` ({bytes} bytes), mapped while it is read (a tensor's pages are released once it is read), and the 64 KiB spans at each tensor's ends")
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_in_binary_units() {
        let p = |s: &str| MemoryBudget::parse(s, "--max-memory").map(MemoryBudget::get);
        assert_eq!(p("8G").unwrap(), 8 << 30);
        assert_eq!(p("512M").unwrap(), 512 << 20);
        assert_eq!(p("512MiB").unwrap(), 512 << 20);
        assert_eq!(p("1.5g").unwrap(), 3 << 29);
        assert_eq!(p("2k").unwrap(), 2048);
        assert_eq!(p("1T").unwrap(), 1 << 40);
        assert_eq!(p("1000").unwrap(), 1000);
        assert_eq!(p("64B").unwrap(), 64);
        for bad in ["", "G", "-1G", "0", "eight", "8X", "nan", "inf", "1e30T"] {
            let e = p(bad).unwrap_err().to_string();
            assert!(e.contains("--max-memory"), "{bad}: {e}");
        }
    }

    #[test]
    fn meminfo_is_read_in_kib() {
        let text = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   12000000 kB\n";
        assert_eq!(meminfo_kib(text, "MemAvailable"), Some(12_000_000));
        assert_eq!(meminfo_kib(text, "MemTotal"), Some(24_576_000));
        assert_eq!(meminfo_kib(text, "SwapTotal"), None);
    }

    #[test]
    fn a_tally_refuses_past_its_budget_naming_what_passed_it() {
        let mut t = Tally::new(MemoryBudget::bytes(100), "t.safetensors");
        t.add(60, || "the file".into()).unwrap();
        let e = t.add(50, || "site `wte`".into()).unwrap_err().to_string();
        assert!(
            e.contains("t.safetensors") && e.contains("site `wte`"),
            "{e}"
        );
        assert!(e.contains("50 bytes") && e.contains("110 bytes"), "{e}");
        assert!(e.contains("100 bytes (--max-memory"), "{e}");
    }
}
