//! The trace file (docs/trace-format.md): one safetensors file holding every site's factors for a
//! batch, the claimed norms of the clipper under audit, and a `__metadata__` header describing
//! the sites. Everything read from it is checked before it is used: a trace comes from other
//! people's code. The header is read in [`header`], the claimed DP-SGD step in [`step`]; the
//! sites' factors and the claimed norms here.

mod budget;
mod header;
mod rounding;
mod step;

pub use budget::{MemoryBudget, GRADIENT_BLOCK_BYTES};
pub use rounding::ModelRounding;
pub use step::{ParamValues, StepClaim};

use crate::conv::{ConvGeometry, ConvInput};
use crate::error::{bail, Error, Result};
use crate::factors::StoredFactors;
use crate::io::{write_raw, RawTensor};
use crate::precision::Precision;
use crate::site::SiteSpec;
use crate::tensors::{self, has};
use crate::trace::{Site, StoredTrace, Trace};
use crate::trace_shape::{validate_shapes, ConvShape, IdAt, SiteShape};
use budget::Tally;
use header::{read_header, ConvEntry};
use ndarray::{Array1, Array3, ArrayD, Ix1, Ix2, Ix3, IxDyn};
use rayon::prelude::*;
use rounding::{read_model_rounding, write_model_rounding};
use safetensors::SafeTensors;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::ops::Range;
use std::path::Path;
use step::read_step;

pub(crate) const TRACE_FORMAT: &str = "ghost-oracle-trace/1";
/// The format of a trace with at least one convolution stored as its input (a site's `conv`
/// entry and `<name>.inputs` tensor); a trace without one is written as [`TRACE_FORMAT`].
pub(crate) const TRACE_FORMAT_CONV: &str = "ghost-oracle-trace/2";
/// The format of a trace where some site reads another site's backprops tensor as its own (a
/// site's `backprops_of` entry: a bias and its weight share their output's gradient, written
/// once); it may also hold convolutions stored as their input.
pub(crate) const TRACE_FORMAT_SHARED: &str = "ghost-oracle-trace/3";

/// Embedding tables larger than this (rows) are refused: no tokenizer comes near 16.7 M tokens
/// (Gemma's is 262 144), and a `vocab` is a count of rows a judge streams through.
pub(crate) const MAX_VOCAB: usize = 1 << 24;
/// A manifest's element counts above this are refused as absurd: 2⁴⁰ is 1.1 T entries, far
/// beyond any one parameter of a model (what a trace may make the reader hold is bounded by its
/// memory budget, not by this).
pub(crate) const MAX_PARAM_ENTRIES: u64 = 1 << 40;

/// What a trace says besides its factors.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceMeta {
    /// C, the clipping bound the claims were made with.
    pub max_grad_norm: f64,
    /// σ of the step's Gaussian noise, when the trace gives it.
    pub noise_multiplier: Option<f64>,
    /// Name of the clipper that produced the claims, when the exporter says.
    pub clipper: Option<String>,
    /// The per-example norms the clipper computed, in batch order.
    pub claimed_norms: Vec<f64>,
    /// The clip coefficients the clipper applied, when the trace gives them.
    pub claimed_coefficients: Option<Vec<f64>>,
    /// The coarsest dtype of the factor tensors as stored (a mixed-precision trace is only as
    /// accurate as its least precise site).
    pub dtype: Precision,
    /// The precision the model computed in (`__metadata__.compute_dtype`), when the exporter
    /// says. It can be coarser than `dtype`: factors of an f32 model stored as f64 are still
    /// only f32-accurate.
    pub compute_dtype: Option<Precision>,
    /// Per site, the precision it computed in where the exporter says (a site's own
    /// `compute_dtype` in `sites`: under autocast the matmuls ran in bf16, the norms in f32).
    /// Empty, or `None` for a site, where the header's `compute_dtype` holds.
    pub site_compute_dtypes: Vec<Option<Precision>>,
    /// Per site, the coarsest format its factor tensors are stored in (read from the file;
    /// `write_trace` stores every site in `dtype`).
    pub site_dtypes: Vec<Precision>,
    /// The DP-SGD step the library took, when the trace carries it.
    pub step: Option<StepClaim>,
    /// The rounding of the model's own forward and backward in the factors, when the exporter
    /// measured it (`model.rounding` with `__metadata__.model_rounding`).
    pub model_rounding: Option<ModelRounding>,
}

impl TraceMeta {
    /// A trace that claims per-example norms at C and nothing more: no clipper name, noise,
    /// coefficients or step, every site stored in `dtype` and computed as stored. Writers set
    /// what else they have with struct-update syntax.
    pub fn norms(max_grad_norm: f64, claimed_norms: Vec<f64>, dtype: Precision) -> Self {
        TraceMeta {
            max_grad_norm,
            noise_multiplier: None,
            clipper: None,
            claimed_norms,
            claimed_coefficients: None,
            dtype,
            compute_dtype: None,
            site_compute_dtypes: Vec::new(),
            site_dtypes: Vec::new(),
            step: None,
            model_rounding: None,
        }
    }

    /// The precision each site is judged at: the coarser of how it is stored and how it was
    /// computed (its own `compute_dtype`, else the header's).
    pub fn site_precisions(&self) -> Vec<Precision> {
        self.site_dtypes
            .iter()
            .enumerate()
            .map(|(j, &stored)| {
                let computed = self
                    .site_compute_dtypes
                    .get(j)
                    .copied()
                    .flatten()
                    .or(self.compute_dtype);
                computed.map_or(stored, |c| stored.coarser(c))
            })
            .collect()
    }
}

/// Reads and validates a trace file within the machine's available memory
/// ([`MemoryBudget::machine`]).
pub fn read_trace(path: &Path) -> Result<(Trace, TraceMeta)> {
    read_trace_within(path, MemoryBudget::machine())
}

/// Reads and validates a trace file, refusing it before holding anything when reading and
/// judging it would hold more than `budget`. The file is mapped, not read: each tensor's pages
/// are brought in as it is copied or widened and dropped from the process once it is, so the
/// file's bytes are never all resident together (at most its largest tensor's and its header).
pub fn read_trace_within(path: &Path, budget: MemoryBudget) -> Result<(Trace, TraceMeta)> {
    let (trace, meta) = read_mapped(path, budget, Holding::F64)?;
    Ok((trace.into_f64(), meta))
}

/// [`read_trace_within`] with every factor held in the precision it is stored in (f64 as f64;
/// f32, f16 and bf16 as f32, exactly) instead of widened to f64: what `check` judges, an example
/// widened at a time ([`crate::Factors`]). The budget counts the factors at those widths.
pub fn read_stored_trace_within(
    path: &Path,
    budget: MemoryBudget,
) -> Result<(StoredTrace, TraceMeta)> {
    read_mapped(path, budget, Holding::Stored)
}

/// A mapped trace file read with its factors held as `holding` says.
fn read_mapped(
    path: &Path,
    budget: MemoryBudget,
    holding: Holding,
) -> Result<(StoredTrace, TraceMeta)> {
    let label = path.display().to_string();
    let map = tensors::map_file(path, "trace")?;
    let release = |range: Range<usize>| -> Result<()> {
        tensors::release_pages(&map, range.clone()).map_err(|e| {
            Error::new(format!(
                "{label}: cannot release the pages of bytes {range:?} once read: {e}"
            ))
        })
    };
    read_trace_parts(&map, &label, budget, holding, Some(&release))
}

/// Parses and validates a trace file's contents within the machine's available memory; `label`
/// names it in messages.
pub fn read_trace_bytes(bytes: &[u8], label: &str) -> Result<(Trace, TraceMeta)> {
    read_trace_bytes_within(bytes, label, MemoryBudget::machine())
}

/// Parses and validates a trace file's contents; `label` names it in messages. Before any float
/// tensor is converted, what reading and judging it would hold (the bytes, every factor widened
/// to f64, the blocks of gradient a judge streams, the claims) is held to `budget`.
pub fn read_trace_bytes_within(
    bytes: &[u8],
    label: &str,
    budget: MemoryBudget,
) -> Result<(Trace, TraceMeta)> {
    let (trace, meta) = read_trace_parts(bytes, label, budget, Holding::F64, None)?;
    Ok((trace.into_f64(), meta))
}

/// [`read_trace_bytes_within`] with every factor held in the precision it is stored in, as
/// [`read_stored_trace_within`].
pub fn read_stored_trace_bytes_within(
    bytes: &[u8],
    label: &str,
    budget: MemoryBudget,
) -> Result<(StoredTrace, TraceMeta)> {
    read_trace_parts(bytes, label, budget, Holding::Stored, None)
}

/// How a trace's float factors are held once read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Holding {
    /// Every factor widened to f64 as it is read.
    F64,
    /// f64 factors as f64, f32, f16 and bf16 ones as f32 (exact); widened an example at a time
    /// by whoever reads them.
    Stored,
}

/// Hands back a byte range of the trace, a tensor's, once the tensor has been copied or widened
/// out of it: the reader never touches those bytes again.
type Release<'a> = &'a dyn Fn(Range<usize>) -> Result<()>;

/// Called with a tensor's name once it has been copied or widened out of the file, once a
/// tensor: passes its byte range to the [`Release`] hook, where there is one.
type Done<'a> = &'a dyn Fn(&str) -> Result<()>;

/// [`read_trace_bytes_within`], handing each tensor's bytes to `release` (when given) as soon as
/// they are read. Without it the bytes are held whole all along, and count so in the budget;
/// with it, its header and one tensor's at a time (see [`Tally::add_mapped_tensors`]).
fn read_trace_parts(
    bytes: &[u8],
    label: &str,
    budget: MemoryBudget,
    holding: Holding,
    release: Option<Release>,
) -> Result<(StoredTrace, TraceMeta)> {
    let mut tally = Tally::new(budget, label);
    let file_len = bytes.len() as u64;
    // The header's length as the file states it, where it fits the file (else the parse below
    // refuses the file), so that a header too large for the budget is refused before it is
    // parsed.
    let stated_header = bytes
        .get(..8)
        .map(|n| u64::from_le_bytes(n.try_into().expect("8 bytes")).saturating_add(8))
        .filter(|&h| h <= file_len);
    let counted_whole = match (release, stated_header) {
        (Some(_), Some(header)) => tally.add_mapped_header(file_len, header)?,
        _ => {
            tally.add(file_len, || "the file (held while it is read)".into())?;
            true
        }
    };
    let (header_len, metadata) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::new(format!("{label} is not a valid safetensors file ({e})")))?;
    let st = tensors::parse(bytes, label)?;
    // Each tensor's range in `bytes`: after the 8-byte header length and the header.
    let data_start = 8 + header_len;
    let extent = |name: &str| {
        let (start, end) = metadata
            .info(name)
            .expect("a tensor named in the file's header")
            .data_offsets;
        data_start + start..data_start + end
    };
    if !counted_whole {
        let largest = st
            .iter()
            .map(|(name, view)| (view.data().len(), name))
            .max();
        tally.add_mapped_tensors(file_len, data_start as u64, largest, st.len())?;
    }
    let done = |name: &str| -> Result<()> {
        match release {
            Some(release) => release(extent(name)),
            None => Ok(()),
        }
    };
    let meta = metadata.metadata().clone().unwrap_or_default();
    let header = read_header(&meta, label)?;
    // Every tensor a site or a claim reads; any other is an error.
    let mut expected: HashSet<String> = HashSet::new();
    let (sites, site_dtypes) = read_sites(
        &st,
        header
            .specs
            .into_iter()
            .zip(header.site_convs)
            .zip(header.site_backprops_of)
            .map(|((spec, conv), of)| (spec, conv, of))
            .collect(),
        header.manifest.as_ref(),
        label,
        &mut expected,
        (&mut tally, holding),
        &done,
    )?;
    let trace = Trace { sites };
    // The claims and the step are copied out of the file in their own formats.
    for (name, view) in st.tensors() {
        if !expected.contains(&name) {
            let n = view.data().len() as u64;
            tally.add(n, || format!("tensor `{name}`, copied as stored"))?;
        }
    }
    let (claimed_norms, claimed_coefficients) =
        read_claims(&st, trace.batch_size(), label, &mut expected, &done)?;
    let step = read_step(&st, &meta, &trace, label, &mut expected, &done)?;
    let model_rounding =
        read_model_rounding(&st, &meta, trace.batch_size(), label, &mut expected, &done)?;
    for name in st.names() {
        if !expected.contains(name) {
            bail!("{label}: unexpected tensor `{name}` (no site in `__metadata__.sites` reads it)");
        }
    }
    let meta = TraceMeta {
        max_grad_norm: header.max_grad_norm,
        noise_multiplier: header.noise_multiplier,
        clipper: header.clipper,
        claimed_norms,
        claimed_coefficients,
        dtype: site_dtypes
            .iter()
            .copied()
            .max()
            .expect("at least one site"),
        compute_dtype: header.compute_dtype,
        site_compute_dtypes: header.site_compute_dtypes,
        site_dtypes,
        step,
        model_rounding,
    };
    Ok((trace, meta))
}

/// One site's tensors as the file holds them, before their shapes are checked.
struct SiteTensors {
    spec: SiteSpec,
    /// The tensor the site reads as its backprops: `<name>.backprops`, or, where the site carries
    /// `backprops_of`, that site's.
    backprops_tensor: String,
    backprops_of: Option<String>,
    backprops: Vec<usize>,
    activations: Option<Vec<usize>>,
    ids: Option<ArrayD<i64>>,
    /// A convolution stored as its input: its geometry (spatial sizes from the tensor) and the
    /// inputs' dimensions B × C_in × ∏S.
    conv: Option<(ConvGeometry, [usize; 3])>,
}

impl SiteTensors {
    fn shape(&self) -> SiteShape<'_> {
        SiteShape {
            conv: self.conv.as_ref().map(|(geometry, inputs)| ConvShape {
                geometry,
                inputs: inputs.as_slice(),
            }),
            spec: &self.spec,
            backprops: &self.backprops,
            activations: self.activations.as_deref(),
            ids: self.ids.as_ref().map(|i| i.shape()),
            id_range: self
                .ids
                .as_ref()
                .filter(|i| i.ndim() == 2)
                .and_then(|i| IdAt::extremes(i.iter().copied(), i.shape()[1])),
        }
    }
}

/// A site of the header: its spec, its `conv` entry and its `backprops_of`.
type SiteEntry = (SiteSpec, Option<ConvEntry>, Option<String>);

/// Every site's tensors as the file holds them: the float factors' shapes only, the ids read.
fn site_tensors(
    st: &SafeTensors,
    specs: Vec<SiteEntry>,
    label: &str,
    expected: &mut HashSet<String>,
    done: Done,
) -> Result<Vec<SiteTensors>> {
    let mut found = Vec::with_capacity(specs.len());
    for (spec, conv, backprops_of) in specs {
        let n = spec.name.clone();
        let dims = |what: &str, expected: &mut HashSet<String>| -> Option<Vec<usize>> {
            let tname = format!("{n}.{what}");
            let view = st.tensor(&tname).ok()?;
            expected.insert(tname);
            Some(view.shape().to_vec())
        };
        let (backprops_tensor, backprops) = match &backprops_of {
            None => {
                let Some(backprops) = dims("backprops", expected) else {
                    bail!(
                        "{label}: site `{n}` ({}): tensor `{n}.backprops` is missing",
                        spec.kind.name()
                    );
                };
                (format!("{n}.backprops"), backprops)
            }
            Some(other) => shared_backprops(st, &n, other, label, expected)?,
        };
        let conv = match conv {
            Some(entry) => Some(conv_tensor(st, &n, entry, label, expected)?),
            None => None,
        };
        let activations = if spec.kind.needs_activations() && conv.is_none() {
            dims("activations", expected)
        } else {
            None
        };
        let ids = if spec.kind.needs_ids() && has(st, &format!("{n}.ids")) {
            let tname = format!("{n}.ids");
            expected.insert(tname.clone());
            let ids = tensors::to_i64(st, &tname, label)?;
            done(&tname)?;
            Some(ids)
        } else {
            None
        };
        found.push(SiteTensors {
            spec,
            backprops_tensor,
            backprops_of,
            backprops,
            activations,
            ids,
            conv,
        });
    }
    Ok(found)
}

/// The backprops tensor of site `n`, which carries `backprops_of: other` (checked in the header
/// to name another site that holds its own): `<other>.backprops`, its name and dimensions; a
/// `<n>.backprops` beside it is refused. Its shape is held to what site `n` needs with every
/// other site's, in `validate_shapes`.
fn shared_backprops(
    st: &SafeTensors,
    n: &str,
    other: &str,
    label: &str,
    expected: &mut HashSet<String>,
) -> Result<(String, Vec<usize>)> {
    if has(st, &format!("{n}.backprops")) {
        bail!("{label}: site `{n}`: tensor `{n}.backprops` is given but the site carries `backprops_of` (its backprops are site `{other}`'s tensor `{other}.backprops`); a site holds one or the other");
    }
    let tname = format!("{other}.backprops");
    let Ok(view) = st.tensor(&tname) else {
        bail!("{label}: site `{n}` reads the backprops of site `{other}` (`backprops_of`), but tensor `{tname}` is missing");
    };
    expected.insert(tname.clone());
    let dims = view.shape().to_vec();
    Ok((tname, dims))
}

/// A conv-input site's `<n>.inputs` (B × C_in × S_1 × … × S_n) and its geometry, from the
/// tensor's shape alone; a `<n>.activations` beside it is refused.
fn conv_tensor(
    st: &SafeTensors,
    n: &str,
    entry: ConvEntry,
    label: &str,
    expected: &mut HashSet<String>,
) -> Result<(ConvGeometry, [usize; 3])> {
    if has(st, &format!("{n}.activations")) {
        bail!("{label}: site `{n}`: tensor `{n}.activations` is given but the site carries `conv` (stored as its convolution's input, tensor `{n}.inputs`); a site holds one or the other");
    }
    let tname = format!("{n}.inputs");
    let Ok(view) = st.tensor(&tname) else {
        bail!("{label}: site `{n}` (linear, `conv`): tensor `{tname}` is missing");
    };
    expected.insert(tname.clone());
    let shape = view.shape();
    let axes = entry.kernel.len();
    if shape.len() != 2 + axes {
        bail!("{label}: site `{n}`: tensor `{tname}` has shape {shape:?}; expected batch × channels × {axes} spatial axes (the length of `conv.kernel`)");
    }
    let spatial = shape[2..]
        .iter()
        .try_fold(1usize, |a, &x| a.checked_mul(x))
        .ok_or_else(|| {
            Error::new(format!(
                "{label}: site `{n}`: tensor `{tname}`'s shape {shape:?} overflows"
            ))
        })?;
    let geometry = ConvGeometry {
        kernel: entry.kernel,
        stride: entry.stride,
        dilation: entry.dilation,
        padding: entry.padding,
        groups: entry.groups,
        input_size: shape[2..].to_vec(),
    };
    Ok((geometry, [shape[0], shape[1], spatial]))
}

/// Each site's gradient against the manifest's count, and what judging the trace would hold
/// against the budget: every site's factors as `holding` holds them (widened to f64, or at
/// `width(site, factor)` bytes a value as stored) and its ids; a LayerNorm site's elementwise
/// product (the whole batch's where the factors are f64, one example's a thread where they are
/// widened an example at a time, with each thread's one example of every factor widened); and
/// the blocks of per-example gradients a judge holds while it streams the largest parameter
/// ([`GRADIENT_BLOCK_BYTES`] of rows for the whole batch, plus a few more).
fn check_sizes(
    shapes: &[SiteShape],
    manifest: Option<&BTreeMap<String, usize>>,
    label: &str,
    tally: &mut Tally,
    holding: Holding,
    width: &dyn Fn(usize, &str) -> u64,
) -> Result<()> {
    let mut streamed: BTreeMap<&str, (u64, u64)> = BTreeMap::new();
    // The most f64 values one example of a site widens to (its factors, a LayerNorm site's
    // product): what each thread holds at once when the factors are held as stored.
    let mut widest_example = 0u64;
    for (j, s) in shapes.iter().enumerate() {
        let (n, param) = (&s.spec.name, &s.spec.param);
        let (rows, cols) = s.gradient_shape();
        let entries = (rows as u128) * (cols as u128);
        if let Some(&count) = manifest.and_then(|m| m.get(param)) {
            if entries != count as u128 {
                bail!(
                    "{label}: site `{n}` writes a {rows}×{cols} gradient ({entries} entries) but `__metadata__.parameters` lists parameter `{param}` with {count} elements"
                );
            }
        }
        let count = |d: &[usize]| d.iter().fold(1u64, |a, &x| a.saturating_mul(x as u64));
        // One example's values of a tensor (its dimensions past the batch's).
        let per_example = |d: &[usize]| count(d.get(1..).unwrap_or(&[]));
        let held = |d: &[usize], what: &str| {
            let w = match holding {
                Holding::F64 => 8,
                Holding::Stored => width(j, what),
            };
            count(d).saturating_mul(w)
        };
        let mut bytes = held(s.backprops, "backprops");
        let mut example = per_example(s.backprops);
        if let Some(a) = s.activations {
            bytes = bytes.saturating_add(held(a, "activations"));
            example = example.saturating_add(per_example(a));
        }
        if s.spec.kind == crate::site::SiteKind::LayerNorm {
            match holding {
                Holding::F64 => bytes = bytes.saturating_add(count(s.backprops).saturating_mul(8)),
                Holding::Stored => example = example.saturating_add(per_example(s.backprops)),
            }
        }
        if let Some(c) = &s.conv {
            // The inputs, and one example's unfolded tile at a time: its (P·g) × (C_in/g·∏k)
            // patches and its (P·g) × C_out spread backprops.
            let unfolded = (s.backprops[1] as u64).saturating_mul(c.geometry.groups as u64);
            bytes = bytes
                .saturating_add(held(c.inputs, "inputs"))
                .saturating_add(unfolded.saturating_mul(cols as u64).saturating_mul(8))
                .saturating_add(unfolded.saturating_mul(rows as u64).saturating_mul(8));
            example = example.saturating_add(per_example(c.inputs));
        }
        widest_example = widest_example.max(example);
        let ids = s.ids.map_or(0, count);
        let bytes = bytes.saturating_add(ids.saturating_mul(8));
        tally.add(bytes, || match holding {
            Holding::F64 => format!(
                "site `{n}` ({}): its factors widened to f64",
                s.spec.kind.name()
            ),
            Holding::Stored => {
                format!("site `{n}` ({}): its factors as stored", s.spec.kind.name())
            }
        })?;
        streamed.insert(param, (rows as u64, cols as u64));
    }
    if holding == Holding::Stored {
        let threads = rayon::current_num_threads() as u64;
        tally.add(
            widest_example.saturating_mul(8).saturating_mul(threads),
            || {
                format!(
                    "one example of the widest site widened to f64 on each of {threads} threads"
                )
            },
        )?;
    }
    let b = shapes.first().map_or(1, |s| s.backprops[0]).max(1) as u64;
    // The judge streams one parameter at a time (`for_each_param_block`), so the largest
    // parameter's blocks are what it holds, not every parameter's together.
    let largest = streamed
        .into_iter()
        .map(|(param, (rows, cols))| {
            let row_bytes = cols.saturating_mul(8).saturating_mul(b).max(1);
            let block_rows = (GRADIENT_BLOCK_BYTES as u64 / row_bytes).clamp(1, rows.max(1));
            // Every example's block, one site's apart, their sum and the step's two targets.
            let bytes = block_rows
                .saturating_mul(cols)
                .saturating_mul(8)
                .saturating_mul(b + 3);
            (bytes, param, rows, cols)
        })
        .max_by_key(|&(bytes, ..)| bytes);
    if let Some((bytes, param, rows, cols)) = largest {
        tally.add(bytes, || {
            format!("parameter `{param}` ({rows}×{cols}): the blocks of its per-example gradients judged at a time (the largest parameter's; one parameter is judged at a time)")
        })?;
    }
    Ok(())
}

/// Reads every site's factors: their shapes are checked from the header (and the ids) before
/// any float tensor is converted, then each site's gradient against the manifest and what
/// judging it holds against the budget. Returns the sites and the coarsest format each is stored in.
fn read_sites(
    st: &SafeTensors,
    specs: Vec<SiteEntry>,
    manifest: Option<&BTreeMap<String, usize>>,
    label: &str,
    expected: &mut HashSet<String>,
    (tally, holding): (&mut Tally, Holding),
    done: Done,
) -> Result<(Vec<Site<StoredFactors>>, Vec<Precision>)> {
    let found = site_tensors(st, specs, label, expected, done)?;
    let shapes: Vec<SiteShape> = found.iter().map(SiteTensors::shape).collect();
    validate_shapes(&shapes)
        .map_err(|e| Error::new(format!("{label}: {}", shared_note(e, &found))))?;
    // Bytes a value of site j's factor is held in, as stored: f64 in 8, every narrower format
    // in f32's 4.
    let width = |j: usize, what: &str| -> u64 {
        let tname = match what {
            "backprops" => found[j].backprops_tensor.clone(),
            _ => format!("{}.{what}", found[j].spec.name),
        };
        let stored = st
            .tensor(&tname)
            .ok()
            .and_then(|v| Precision::of_stored(v.dtype()));
        match stored {
            Some(Precision::F64) | None => 8,
            Some(Precision::F32 | Precision::F16 | Precision::BF16) => 4,
        }
    };
    check_sizes(&shapes, manifest, label, tally, holding, &width)?;
    // A tensor that several sites read (`backprops_of`) is widened into each of them, which the
    // budget counts, and its pages handed back after each read (the next faults them in again):
    // so a mapped file never has more than one tensor's pages in, as the budget counts it.
    // Held as stored, such a tensor is read once and its later readers share it (the budget
    // still counts a copy each: an upper bound).
    let mut readers: HashMap<String, usize> = HashMap::new();
    for f in &found {
        *readers.entry(f.backprops_tensor.clone()).or_default() += 1;
    }
    let mut shared: HashMap<String, StoredFactors> = HashMap::new();
    let mut sites = Vec::with_capacity(found.len());
    let mut dtypes = Vec::with_capacity(found.len());
    for f in found {
        let n = &f.spec.name;
        let mut dtype = None;
        // Checked 3-D above; `tensors::to_f64` and `to_f32` refuse every dtype that is not a
        // float format.
        let mut factor = |what: &str, dims: Option<[usize; 3]>| -> Result<StoredFactors> {
            let tname = match what {
                "backprops" => f.backprops_tensor.clone(),
                _ => format!("{n}.{what}"),
            };
            let stored = st
                .tensor(&tname)
                .ok()
                .and_then(|v| Precision::of_stored(v.dtype()));
            if let (Holding::Stored, Some(held), Some(p)) = (holding, shared.get(&tname), stored) {
                dtype = Some(coarser(dtype, p));
                return Ok(held.clone());
            }
            let a: StoredFactors = match (holding, stored) {
                (Holding::F64, _) | (Holding::Stored, Some(Precision::F64) | None) => {
                    three(tensors::to_f64(st, &tname, label)?, dims, &tname)?.into()
                }
                (Holding::Stored, Some(Precision::F32 | Precision::F16 | Precision::BF16)) => {
                    three(to_f32(st, &tname, label)?, dims, &tname)?.into()
                }
            };
            // Its bytes are read: a mapped file's pages go back as each factor is widened or
            // copied, so the file and the factors are never resident together.
            done(&tname)?;
            if holding == Holding::Stored && readers.get(&tname).is_some_and(|&k| k > 1) {
                shared.insert(tname.clone(), a.clone());
            }
            let stored = stored.expect("a float tensor, or `to_f64` refused it");
            dtype = Some(coarser(dtype, stored));
            Ok(a)
        };
        let backprops = factor("backprops", None)?;
        let activations = match f.activations {
            Some(_) => Some(factor("activations", None)?),
            None => None,
        };
        let conv = match f.conv {
            Some((geometry, dims)) => Some(ConvInput {
                geometry,
                inputs: factor("inputs", Some(dims))?,
            }),
            None => None,
        };
        dtypes.push(dtype.expect("a site has backprops"));
        sites.push(Site {
            activations,
            ids: f
                .ids
                .map(|i| i.into_dimensionality::<Ix2>().expect("checked 2-D")),
            backprops,
            spec: f.spec,
            conv,
        });
    }
    Ok((sites, dtypes))
}

/// A factor read as a float tensor, 3-D: `dims` for a convolution's inputs (their spatial axes
/// flattened, row-major as stored), its own (checked 3-D) otherwise.
fn three<T>(a: ArrayD<T>, dims: Option<[usize; 3]>, tname: &str) -> Result<Array3<T>> {
    Ok(match dims {
        Some(d) => a
            .into_shape_with_order(d)
            .map_err(|e| Error::internal(format!("`{tname}`: {e}")))?,
        None => a.into_dimensionality::<Ix3>().expect("checked 3-D"),
    })
}

/// A float tensor stored as f32, f16 or bf16, as f32 (which holds each exactly), with NaN and ±∞
/// refused as [`tensors::to_f64`] refuses them; decoded straight from the file's bytes, a chunk a
/// task.
fn to_f32(st: &SafeTensors, name: &str, label: &str) -> Result<ArrayD<f32>> {
    fn decode<const N: usize>(bytes: &[u8], out: &mut [f32], w: impl Fn([u8; N]) -> f32 + Sync) {
        const CHUNK: usize = 1 << 16;
        out.par_chunks_mut(CHUNK)
            .zip(bytes.par_chunks(CHUNK * N))
            .for_each(|(o, b)| {
                for (v, c) in o.iter_mut().zip(b.chunks_exact(N)) {
                    *v = w(c.try_into().expect("chunks of N bytes"));
                }
            });
    }
    let view = st
        .tensor(name)
        .map_err(|_| Error::new(format!("{label}: tensor `{name}` is missing")))?;
    let (dtype, bytes) = (view.dtype(), view.data());
    let width = tensors::float_width(dtype, name, label)?;
    let mut values = vec![0.0f32; bytes.len() / width];
    match dtype {
        safetensors::Dtype::F32 => decode(bytes, &mut values, f32::from_le_bytes),
        safetensors::Dtype::F16 => {
            decode(bytes, &mut values, |c| half::f16::from_le_bytes(c).to_f32())
        }
        safetensors::Dtype::BF16 => decode(bytes, &mut values, |c| {
            half::bf16::from_le_bytes(c).to_f32()
        }),
        other => bail!("{label}: tensor `{name}` ({other:?}) is not a format f32 holds exactly"),
    }
    // A chunk a task, each scanned in a plain loop (a parallel search item by item costs more
    // than the decoding).
    const CHUNK: usize = 1 << 16;
    let first = values
        .par_chunks(CHUNK)
        .enumerate()
        .find_map_first(|(k, c)| {
            let at = c.iter().position(|v| !v.is_finite())?;
            Some((k * CHUNK + at, c[at]))
        });
    if let Some((index, v)) = first {
        bail!(
            "{label}: tensor `{name}` holds a non-finite value ({}) at flat index {index}",
            f64::from(v)
        );
    }
    ArrayD::from_shape_vec(IxDyn(view.shape()), values)
        .map_err(|e| Error::new(format!("{label}: tensor `{name}`: {e}")))
}

/// A shape error as `validate_shapes` words it, which names a site's backprops `<name>.backprops`,
/// with the tensor a `backprops_of` site really reads added.
fn shared_note(e: Error, found: &[SiteTensors]) -> String {
    let mut message = e.to_string();
    for f in found {
        if let Some(other) = &f.backprops_of {
            let n = &f.spec.name;
            if message.contains(&format!("`{n}.backprops`")) {
                message.push_str(&format!(" (site `{n}` carries `backprops_of`: its backprops are tensor `{other}.backprops`)"));
            }
        }
    }
    message
}

/// The clipper's claims: one norm (and optionally one coefficient) per example of a batch of
/// `b`. Claims may be NaN or infinite: that is the clipper's defect, judged as a verdict.
fn read_claims(
    st: &SafeTensors,
    b: usize,
    label: &str,
    expected: &mut HashSet<String>,
    done: Done,
) -> Result<(Vec<f64>, Option<Vec<f64>>)> {
    let mut vector = |name: &str| -> Result<Vec<f64>> {
        expected.insert(name.to_string());
        let a = tensors::to_f64_unchecked(st, name, label)?;
        done(name)?;
        let shape = a.shape().to_vec();
        let a = a.into_dimensionality::<Ix1>().map_err(|_| {
            Error::new(format!(
                "{label}: `{name}` has shape {shape:?}; expected ({b})"
            ))
        })?;
        if a.len() != b {
            bail!(
                "{label}: `{name}` has {} entries but the batch has {b} examples",
                a.len()
            );
        }
        Ok(a.to_vec())
    };
    if !has(st, "claimed.norms") {
        bail!(
            "{label}: tensor `claimed.norms` is missing (the per-example norms the clipper used)"
        );
    }
    let norms = vector("claimed.norms")?;
    let coefficients = if has(st, "claimed.coefficients") {
        Some(vector("claimed.coefficients")?)
    } else {
        None
    };
    Ok((norms, coefficients))
}

/// The less precise of the formats seen so far and another (a trace is only as accurate as its
/// coarsest factor).
fn coarser(a: Option<Precision>, b: Precision) -> Precision {
    a.map_or(b, |a| a.coarser(b))
}

/// Writes a trace file; factor tensors in `dtype`, claims in f64.
pub fn write_trace(path: &Path, trace: &Trace, meta: &TraceMeta) -> Result<()> {
    let mut m = header::written(trace, meta);
    let mut raw = Vec::new();
    for s in &trace.sites {
        let n = &s.spec.name;
        if let Some(a) = &s.activations {
            raw.push((
                format!("{n}.activations"),
                RawTensor::from_f64(&a.view().into_dyn(), meta.dtype),
            ));
        }
        if let Some(c) = &s.conv {
            // B × C_in × S_1 × … × S_n, as torch holds a convolution's input.
            let (b, channels, _) = c.inputs.dim();
            let mut shape = vec![b, channels];
            shape.extend(&c.geometry.input_size);
            let standard = c.inputs.as_standard_layout();
            let inputs = standard
                .view()
                .into_shape_with_order(shape)
                .map_err(|e| Error::internal(format!("site `{n}`: its inputs: {e}")))?;
            raw.push((
                format!("{n}.inputs"),
                RawTensor::from_f64(&inputs, meta.dtype),
            ));
        }
        if let Some(ids) = &s.ids {
            raw.push((
                format!("{n}.ids"),
                RawTensor::from_i64(&ids.view().into_dyn()),
            ));
        }
        raw.push((
            format!("{n}.backprops"),
            RawTensor::from_f64(&s.backprops.view().into_dyn(), meta.dtype),
        ));
    }
    let norms = Array1::from(meta.claimed_norms.clone()).into_dyn();
    raw.push((
        "claimed.norms".to_string(),
        RawTensor::from_f64(&norms.view(), Precision::F64),
    ));
    if let Some(c) = &meta.claimed_coefficients {
        let c = Array1::from(c.clone()).into_dyn();
        raw.push((
            "claimed.coefficients".to_string(),
            RawTensor::from_f64(&c.view(), Precision::F64),
        ));
    }
    if let Some(step) = &meta.step {
        step::write_step(step, &mut raw, &mut m);
    }
    if let Some(r) = &meta.model_rounding {
        write_model_rounding(r, &mut raw, &mut m);
    }
    write_raw(path, &raw, Some(m))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::site::SiteKind;
    use crate::tensors::Floats;
    use std::cell::RefCell;

    fn spec(name: &str, kind: SiteKind, vocab: Option<usize>) -> SiteSpec {
        SiteSpec {
            name: name.to_string(),
            param: format!("{name}.weight"),
            kind,
            vocab,
        }
    }

    /// Values that differ from tensor to tensor and entry to entry.
    fn values(shape: (usize, usize, usize), seed: f64) -> Array3<f64> {
        Array3::from_shape_fn(shape, |(i, r, c)| {
            ((i * 31 + r * 7 + c) as f64 * 0.37 + seed).sin()
        })
    }

    /// A /2 trace holding every kind of tensor a trace file can: ids, activations, a
    /// convolution's inputs, backprops, the claimed norms and coefficients, the step's sums and
    /// update, and the model's rounding; factors in f32.
    fn every_tensor() -> (Trace, TraceMeta) {
        let b = 2;
        let geometry = ConvGeometry {
            kernel: vec![2],
            stride: vec![1],
            dilation: vec![1],
            padding: vec![(0, 0)],
            groups: 1,
            input_size: vec![4],
        };
        let sites = vec![
            Site {
                spec: spec("emb", SiteKind::Embedding, Some(5)),
                activations: None,
                ids: Some(ndarray::Array2::from_shape_fn((b, 3), |(i, t)| {
                    ((i + 2 * t) % 5) as i64
                })),
                backprops: values((b, 3, 4), 0.1),
                conv: None,
            },
            Site {
                spec: spec("fc", SiteKind::Linear, None),
                activations: Some(values((b, 3, 4), 0.2)),
                ids: None,
                backprops: values((b, 3, 2), 0.3),
                conv: None,
            },
            Site {
                spec: spec("conv", SiteKind::Linear, None),
                activations: None,
                ids: None,
                // 3 channels over 4 positions, kernel 2: 3 output positions of 2 channels.
                backprops: values((b, 3, 2), 0.4),
                conv: Some(ConvInput {
                    geometry,
                    inputs: values((b, 3, 4), 0.5),
                }),
            },
        ];
        let trace = Trace { sites };
        let sums = |seed: f64| -> ParamValues {
            trace
                .params()
                .iter()
                .map(|(p, js)| {
                    let (rows, cols) = trace.site_gradient_shape(js[0]);
                    let v: Vec<f32> = (0..rows * cols)
                        .map(|k| (k as f32 * 0.1 + seed as f32).cos())
                        .collect();
                    (p.clone(), Floats::from(v))
                })
                .collect()
        };
        let meta = TraceMeta {
            claimed_coefficients: Some(vec![0.5, 1.0]),
            step: Some(StepClaim {
                clipped_sum: Some(sums(0.6)),
                update: Some(sums(0.7)),
                batch_divisor: Some(2.0),
                clip_stabilizer: 1e-6,
                clipping: crate::clipping::Clipping::Flat,
            }),
            model_rounding: Some(ModelRounding {
                method: "replay-float64".into(),
                per_example: vec![1e-9, 2e-9],
            }),
            site_dtypes: vec![Precision::F32; 3],
            site_compute_dtypes: vec![None; 3],
            ..TraceMeta::norms(1.0, vec![0.8, 1.2], Precision::F32)
        };
        (trace, meta)
    }

    #[test]
    fn every_tensor_is_released_exactly_once_and_the_trace_read_is_the_same() {
        let dir =
            std::env::temp_dir().join(format!("ghost-oracle-trace-release-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("t.safetensors");
        let (trace, meta) = every_tensor();
        write_trace(&path, &trace, &meta).unwrap();
        let bytes = std::fs::read(&path).unwrap();
        let released = RefCell::new(Vec::new());
        let hook = |range: Range<usize>| -> Result<()> {
            released.borrow_mut().push(range);
            Ok(())
        };
        let budget = MemoryBudget::bytes(1 << 30);
        let (read, read_meta) =
            read_trace_parts(&bytes, "T", budget, Holding::F64, Some(&hook)).unwrap();
        let read = read.into_f64();

        // Every tensor's byte range, from the header as the safetensors crate reads it.
        let (n, header) = SafeTensors::read_metadata(&bytes).unwrap();
        let mut every: Vec<(Range<usize>, String)> = header
            .tensors()
            .into_iter()
            .map(|(name, info)| {
                let (s, e) = info.data_offsets;
                (8 + n + s..8 + n + e, name)
            })
            .collect();
        every.sort_by_key(|(r, _)| (r.start, r.end));
        let mut got = released.into_inner();
        got.sort_by_key(|r| (r.start, r.end));
        let want: Vec<Range<usize>> = every.iter().map(|(r, _)| r.clone()).collect();
        assert_eq!(got, want, "released ranges against every tensor's");
        // The float tensors among them: the site factors and the claims, the step and the
        // rounding; the ids are the one integer tensor.
        let floats = header
            .tensors()
            .values()
            .filter(|i| Precision::of_stored(i.dtype).is_some())
            .count();
        assert_eq!((floats, every.len()), (14, 15));

        // The hook changes nothing read: the same trace as the bytes read whole.
        let (whole, whole_meta) = read_trace_bytes_within(&bytes, "T", budget).unwrap();
        assert_eq!(read_meta, whole_meta);
        assert_eq!(read_meta, meta);
        for (a, b) in read.sites.iter().zip(&whole.sites) {
            assert_eq!(a.spec, b.spec);
            assert_eq!(a.activations, b.activations);
            assert_eq!(a.ids, b.ids);
            assert_eq!(a.backprops, b.backprops);
            assert_eq!(
                a.conv.as_ref().map(|c| (&c.geometry, &c.inputs)),
                b.conv.as_ref().map(|c| (&c.geometry, &c.inputs))
            );
        }
        assert_eq!(read.sites.len(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
