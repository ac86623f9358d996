//! The trace file (docs/trace-format.md): one safetensors file holding every site's factors for a
//! batch, the claimed norms of the clipper under audit, and a `__metadata__` header describing
//! the sites. Everything read from it is checked before it is used: a trace comes from other
//! people's code.

use crate::error::{bail, Error, Result};
use crate::io::{write_raw, RawTensor};
use crate::precision::Precision;
use crate::site::{SiteKind, SiteSpec};
use crate::tensors::{self, has, Floats, TensorSource};
use crate::trace::{Site, Trace};
use crate::trace_shape::{validate_shapes, IdAt, SiteShape};
use ndarray::{Array1, Array3, ArrayD, Ix1, Ix2, Ix3};
use safetensors::SafeTensors;
use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::Path;

pub(crate) const TRACE_FORMAT: &str = "ghost-oracle-trace/1";

/// Embedding tables larger than this (rows) are refused: materializing one per example is the
/// reference's job, and a header must not be able to ask for terabytes.
pub(crate) const MAX_VOCAB: usize = 1 << 24;
/// Largest gradient (entries) the reference will materialize for one site: 2²⁷ f64 is 1 GiB,
/// three times GPT-2 XL's embedding. Checked before any allocation, since a small file can
/// declare a huge `vocab`.
pub(crate) const MAX_SITE_ENTRIES: usize = 1 << 27;

/// What a trace says besides its factors.
#[derive(Clone, Debug, PartialEq)]
pub struct TraceMeta {
    pub max_grad_norm: f64,
    pub noise_multiplier: Option<f64>,
    /// Name of the clipper that produced the claims, when the exporter says.
    pub clipper: Option<String>,
    pub claimed_norms: Vec<f64>,
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
}

/// How a clipping coefficient is formed from a norm n: flat clipping min(1, C/(n + γ)), or
/// automatic clipping C/(n + γ) (fastDP's default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Clipping {
    Flat,
    Automatic,
}

impl Clipping {
    pub fn name(self) -> &'static str {
        match self {
            Clipping::Flat => "flat",
            Clipping::Automatic => "automatic",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        [Clipping::Flat, Clipping::Automatic]
            .into_iter()
            .find(|c| c.name() == s)
    }

    /// The coefficient of a norm n at clipping norm C and stabilizer γ.
    pub fn coefficient(self, norm: f64, max_grad_norm: f64, stabilizer: f64) -> f64 {
        let c = max_grad_norm / (norm + stabilizer);
        match self {
            Clipping::Flat => c.min(1.0),
            Clipping::Automatic => c,
        }
    }
}

/// One value per entry of each parameter, in the trace's first-use order, row-major in the
/// parameter's layout, in the dtype the library produced it in.
pub type ParamValues = Vec<(String, Floats)>;

/// A library's DP-SGD step over the trace's (logical) batch.
#[derive(Clone, Debug, PartialEq)]
pub struct StepClaim {
    /// `claimed.clipped_sum.<param>`: Σ_i c_i g_i before noise, as the library holds it.
    pub clipped_sum: Option<ParamValues>,
    /// `claimed.update.<param>`: the noisy sum divided by `batch_divisor`.
    pub update: Option<ParamValues>,
    /// What the library says it divides the noisy sum by (required with `update`).
    pub batch_divisor: Option<f64>,
    /// γ in the coefficient (`clip_stabilizer`; Opacus uses 1e-6).
    pub clip_stabilizer: f64,
    pub clipping: Clipping,
}

impl TraceMeta {
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

fn parse_compute_dtype(s: &str, label: &str) -> Result<Precision> {
    Precision::parse(s).ok_or_else(|| {
        Error::new(format!(
            "{label}: `__metadata__.compute_dtype` is {s:?}; expected one of {}",
            Precision::names()
        ))
    })
}

/// Reads the `parameters` manifest (a JSON object: parameter name -> number of elements) while
/// checking each entry against the parameters the sites write, so that a header cannot make the
/// reader hold more entries than there are sites: a name no site writes is refused as soon as it
/// is read, and so is a name listed twice.
struct ManifestSeed<'a> {
    site_params: &'a HashSet<&'a str>,
}

impl<'de> DeserializeSeed<'de> for ManifestSeed<'_> {
    type Value = BTreeMap<String, usize>;
    fn deserialize<D: de::Deserializer<'de>>(
        self,
        d: D,
    ) -> std::result::Result<Self::Value, D::Error> {
        d.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ManifestSeed<'_> {
    type Value = BTreeMap<String, usize>;
    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str(
            "a JSON object mapping each trainable parameter's name to its number of elements",
        )
    }
    fn visit_map<A: MapAccess<'de>>(
        self,
        mut map: A,
    ) -> std::result::Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        while let Some(name) = map.next_key::<String>()? {
            if !self.site_params.contains(name.as_str()) {
                return Err(de::Error::custom(format!(
                    "parameter `{name}` is listed but no site in `__metadata__.sites` writes it"
                )));
            }
            if out.contains_key(&name) {
                return Err(de::Error::custom(format!(
                    "parameter `{name}` is listed twice"
                )));
            }
            let v: Value = map.next_value()?;
            let count = match v.as_u64() {
                Some(c) if c as usize <= MAX_SITE_ENTRIES => c as usize,
                _ => {
                    return Err(de::Error::custom(format!(
                        "parameter `{name}`: the number of elements must be an integer in 0..={MAX_SITE_ENTRIES}, found {v}"
                    )))
                }
            };
            out.insert(name, count);
        }
        Ok(out)
    }
}

fn parse_manifest(text: &str, specs: &[SiteSpec], label: &str) -> Result<BTreeMap<String, usize>> {
    let site_params: HashSet<&str> = specs.iter().map(|s| s.param.as_str()).collect();
    let mut de = serde_json::Deserializer::from_str(text);
    let manifest = ManifestSeed {
        site_params: &site_params,
    }
    .deserialize(&mut de)
    .and_then(|m| de.end().map(|()| m))
    .map_err(|e| Error::new(format!("{label}: `__metadata__.parameters`: {e}")))?;
    if let Some(s) = specs.iter().find(|s| !manifest.contains_key(&s.param)) {
        bail!(
            "{label}: site `{}` writes parameter `{}`, which `__metadata__.parameters` does not list",
            s.name,
            s.param
        );
    }
    Ok(manifest)
}

fn meta_str<'a>(meta: &'a HashMap<String, String>, key: &str, label: &str) -> Result<&'a str> {
    meta.get(key)
        .map(String::as_str)
        .ok_or_else(|| Error::new(format!("{label}: `__metadata__` has no `{key}`")))
}

fn positive(s: &str, key: &str, label: &str) -> Result<f64> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => bail!("{label}: `__metadata__.{key}` must be a non-negative number, found {s:?}"),
    }
}

fn parse_specs(text: &str, label: &str) -> Result<Vec<(SiteSpec, Option<Precision>)>> {
    let v: Value = serde_json::from_str(text).map_err(|e| {
        Error::new(format!(
            "{label}: `__metadata__.sites` is not valid JSON: {e}"
        ))
    })?;
    let list = v
        .as_array()
        .ok_or_else(|| Error::new(format!("{label}: `__metadata__.sites` must be a JSON list")))?;
    if list.is_empty() {
        bail!("{label}: `__metadata__.sites` lists no site");
    }
    let mut names = HashSet::new();
    list.iter()
        .enumerate()
        .map(|(k, s)| {
            let field = |f: &str| s.get(f).and_then(Value::as_str).map(str::to_string);
            let name = field("name").ok_or_else(|| Error::new(format!("{label}: site #{k} has no string `name`")))?;
            if !names.insert(name.clone()) {
                bail!("{label}: site name `{name}` appears twice");
            }
            let param = field("param").ok_or_else(|| Error::new(format!("{label}: site `{name}` has no string `param`")))?;
            let kind_s = field("kind").ok_or_else(|| Error::new(format!("{label}: site `{name}` has no string `kind`")))?;
            let kind = SiteKind::parse(&kind_s).ok_or_else(|| {
                Error::new(format!(
                    "{label}: site `{name}` has unknown kind `{kind_s}`; expected one of {}",
                    SiteKind::ALL.iter().map(|k| k.name()).collect::<Vec<_>>().join(", ")
                ))
            })?;
            let vocab = match s.get("vocab") {
                None | Some(Value::Null) => None,
                Some(x) => match x.as_u64() {
                    Some(n) if n >= 1 && n as usize <= MAX_VOCAB => Some(n as usize),
                    _ => bail!("{label}: site `{name}`: `vocab` must be an integer in 1..={MAX_VOCAB}, found {x}"),
                },
            };
            if kind == SiteKind::Embedding && vocab.is_none() {
                bail!("{label}: site `{name}` (embedding) needs `vocab`, the number of rows of its table");
            }
            let compute = match s.get("compute_dtype") {
                None | Some(Value::Null) => None,
                Some(x) => Some(x.as_str().and_then(Precision::parse).ok_or_else(|| {
                    Error::new(format!(
                        "{label}: site `{name}`: `compute_dtype` is {x}; expected one of {}",
                        Precision::names()
                    ))
                })?),
            };
            Ok((SiteSpec { name, param, kind, vocab }, compute))
        })
        .collect()
}

/// Reads and validates a trace file.
pub fn read_trace(path: &Path) -> Result<(Trace, TraceMeta)> {
    let bytes = tensors::read_bytes(path, "trace")?;
    read_trace_bytes(&bytes, &path.display().to_string())
}

/// Parses and validates a trace file's contents; `label` names it in messages.
pub fn read_trace_bytes(bytes: &[u8], label: &str) -> Result<(Trace, TraceMeta)> {
    let (_, metadata) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::new(format!("{label} is not a valid safetensors file ({e})")))?;
    let st = tensors::parse(bytes, label)?;
    let meta = metadata.metadata().clone().unwrap_or_default();
    let header = read_header(&meta, label)?;
    // Every tensor a site or a claim reads; any other is an error.
    let mut expected: HashSet<String> = HashSet::new();
    let (sites, site_dtypes) = read_sites(
        &st,
        header.specs,
        header.manifest.as_ref(),
        label,
        &mut expected,
    )?;
    let trace = Trace { sites };
    let (claimed_norms, claimed_coefficients) =
        read_claims(&st, trace.batch_size(), label, &mut expected)?;
    let step = read_step(&st, &meta, &trace, label, &mut expected)?;
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
    };
    Ok((trace, meta))
}

/// What `__metadata__` says, checked.
struct Header {
    max_grad_norm: f64,
    noise_multiplier: Option<f64>,
    clipper: Option<String>,
    compute_dtype: Option<Precision>,
    site_compute_dtypes: Vec<Option<Precision>>,
    specs: Vec<SiteSpec>,
    /// The `parameters` manifest, when the exporter wrote one.
    manifest: Option<BTreeMap<String, usize>>,
}

fn read_header(meta: &HashMap<String, String>, label: &str) -> Result<Header> {
    let format = meta_str(meta, "format", label)?;
    if format != TRACE_FORMAT {
        bail!("{label}: `__metadata__.format` is {format:?}; this version reads {TRACE_FORMAT:?}");
    }
    let max_grad_norm = positive(
        meta_str(meta, "max_grad_norm", label)?,
        "max_grad_norm",
        label,
    )?;
    if max_grad_norm == 0.0 {
        bail!("{label}: `__metadata__.max_grad_norm` must be positive");
    }
    let noise_multiplier = meta
        .get("noise_multiplier")
        .map(|s| positive(s, "noise_multiplier", label))
        .transpose()?;
    let (specs, site_compute_dtypes): (Vec<SiteSpec>, Vec<Option<Precision>>) =
        parse_specs(meta_str(meta, "sites", label)?, label)?
            .into_iter()
            .unzip();
    let compute_dtype = meta
        .get("compute_dtype")
        .map(|s| parse_compute_dtype(s, label))
        .transpose()?;
    let manifest = meta
        .get("parameters")
        .map(|text| parse_manifest(text, &specs, label))
        .transpose()?;
    Ok(Header {
        max_grad_norm,
        noise_multiplier,
        clipper: meta.get("clipper").cloned(),
        compute_dtype,
        site_compute_dtypes,
        specs,
        manifest,
    })
}

/// One site's tensors as the file holds them, before their shapes are checked.
struct SiteTensors {
    spec: SiteSpec,
    backprops: Vec<usize>,
    activations: Option<Vec<usize>>,
    ids: Option<ArrayD<i64>>,
}

impl SiteTensors {
    fn shape(&self) -> SiteShape<'_> {
        SiteShape {
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

/// Reads every site's factors: their shapes are checked from the header (and the ids) before
/// any float tensor is converted, then each site's gradient against the size limit and the
/// manifest. Returns the sites and the coarsest format each is stored in.
fn read_sites(
    st: &SafeTensors,
    specs: Vec<SiteSpec>,
    manifest: Option<&BTreeMap<String, usize>>,
    label: &str,
    expected: &mut HashSet<String>,
) -> Result<(Vec<Site>, Vec<Precision>)> {
    let mut found = Vec::with_capacity(specs.len());
    for spec in specs {
        let n = spec.name.clone();
        let dims = |what: &str, expected: &mut HashSet<String>| -> Option<Vec<usize>> {
            let tname = format!("{n}.{what}");
            let view = st.tensor(&tname).ok()?;
            expected.insert(tname);
            Some(view.shape().to_vec())
        };
        let Some(backprops) = dims("backprops", expected) else {
            bail!(
                "{label}: site `{n}` ({}): tensor `{n}.backprops` is missing",
                spec.kind.name()
            );
        };
        let activations = if spec.kind.needs_activations() {
            dims("activations", expected)
        } else {
            None
        };
        let ids = if spec.kind.needs_ids() && has(st, &format!("{n}.ids")) {
            let tname = format!("{n}.ids");
            expected.insert(tname.clone());
            Some(tensors::to_i64(st, &tname, label)?)
        } else {
            None
        };
        found.push(SiteTensors {
            spec,
            backprops,
            activations,
            ids,
        });
    }
    let shapes: Vec<SiteShape> = found.iter().map(SiteTensors::shape).collect();
    validate_shapes(&shapes).map_err(|e| Error::new(format!("{label}: {e}")))?;
    for s in &shapes {
        let (n, param) = (&s.spec.name, &s.spec.param);
        let (rows, cols) = s.gradient_shape();
        if rows.saturating_mul(cols) > MAX_SITE_ENTRIES {
            bail!("{label}: site `{n}` writes a {rows}×{cols} gradient; at most {MAX_SITE_ENTRIES} entries are materialized");
        }
        if let Some(&count) = manifest.and_then(|m| m.get(param)) {
            if rows * cols != count {
                bail!(
                    "{label}: site `{n}` writes a {rows}×{cols} gradient ({} entries) but `__metadata__.parameters` lists parameter `{param}` with {count} elements",
                    rows * cols
                );
            }
        }
    }

    let mut sites = Vec::with_capacity(found.len());
    let mut dtypes = Vec::with_capacity(found.len());
    for f in found {
        let n = &f.spec.name;
        let mut dtype = None;
        // Checked 3-D above; `tensors::to_f64` refuses every dtype that is not a float format.
        let mut factor = |what: &str| -> Result<Array3<f64>> {
            let tname = format!("{n}.{what}");
            let a = tensors::to_f64(st, &tname, label)?;
            let stored = Precision::of_stored(st.tensor(&tname).expect("checked").dtype())
                .expect("a float tensor");
            dtype = Some(coarser(dtype, stored));
            Ok(a.into_dimensionality::<Ix3>().expect("checked 3-D"))
        };
        let backprops = factor("backprops")?;
        let activations = match f.activations {
            Some(_) => Some(factor("activations")?),
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
        });
    }
    Ok((sites, dtypes))
}

/// The clipper's claims: one norm (and optionally one coefficient) per example of a batch of
/// `b`. Claims may be NaN or infinite: that is the clipper's defect, judged as a verdict.
fn read_claims(
    st: &SafeTensors,
    b: usize,
    label: &str,
    expected: &mut HashSet<String>,
) -> Result<(Vec<f64>, Option<Vec<f64>>)> {
    let mut vector = |name: &str| -> Result<Vec<f64>> {
        expected.insert(name.to_string());
        let a = tensors::to_f64_unchecked(st, name, label)?;
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

/// The step keys: `claimed.clipped_sum.<param>` and `claimed.update.<param>` for every
/// parameter or none, each with the parameter's number of values, and the header's
/// `batch_divisor`, `clip_stabilizer` and `clipping`. Values may be NaN or infinite: that is the
/// library's defect, judged as a verdict.
fn read_step(
    st: &SafeTensors,
    meta: &HashMap<String, String>,
    trace: &Trace,
    label: &str,
    expected: &mut HashSet<String>,
) -> Result<Option<StepClaim>> {
    let params = trace.params();
    let mut sums = |prefix: &str| -> Result<Option<ParamValues>> {
        let names: Vec<&str> = st
            .names()
            .into_iter()
            .filter_map(|n| n.strip_prefix(prefix))
            .collect();
        if names.is_empty() {
            return Ok(None);
        }
        for n in &names {
            if !params.iter().any(|(p, _)| p == n) {
                bail!("{label}: tensor `{prefix}{n}` names no parameter of the trace's sites");
            }
        }
        params
            .iter()
            .map(|(p, js)| {
                let name = format!("{prefix}{p}");
                if !has(st, &name) {
                    bail!("{label}: tensor `{name}` is missing: `{prefix}*` must cover every parameter");
                }
                expected.insert(name.clone());
                let (rows, cols) = trace.site_gradient_shape(js[0]);
                let (dtype, _, bytes) = st.raw(&name, label)?;
                let v = Floats::decode(dtype, &bytes, &name, label)?;
                if v.len() != rows * cols {
                    bail!(
                        "{label}: `{name}` has {} values; parameter `{p}` has {rows}×{cols}",
                        v.len()
                    );
                }
                Ok((p.clone(), v))
            })
            .collect::<Result<Vec<_>>>()
            .map(Some)
    };
    let clipped_sum = sums("claimed.clipped_sum.")?;
    let update = sums("claimed.update.")?;
    let number = |key: &str| meta.get(key).map(|s| positive(s, key, label)).transpose();
    let batch_divisor = number("batch_divisor")?;
    if batch_divisor == Some(0.0) {
        bail!("{label}: `__metadata__.batch_divisor` must be positive");
    }
    if update.is_some() && batch_divisor.is_none() {
        bail!("{label}: `claimed.update.*` needs `__metadata__.batch_divisor`, the number the library divides the noisy sum by");
    }
    let clip_stabilizer = number("clip_stabilizer")?.unwrap_or(0.0);
    let clipping = match meta.get("clipping") {
        None => Clipping::Flat,
        Some(s) => Clipping::parse(s).ok_or_else(|| {
            Error::new(format!(
                "{label}: `__metadata__.clipping` is {s:?}; expected \"flat\" or \"automatic\""
            ))
        })?,
    };
    if clipped_sum.is_none() && update.is_none() {
        return Ok(None);
    }
    Ok(Some(StepClaim {
        clipped_sum,
        update,
        batch_divisor,
        clip_stabilizer,
        clipping,
    }))
}

/// The less precise of the formats seen so far and another (a trace is only as accurate as its
/// coarsest factor).
fn coarser(a: Option<Precision>, b: Precision) -> Precision {
    a.map_or(b, |a| a.coarser(b))
}

/// Writes a trace file; factor tensors in `dtype`, claims in f64.
pub fn write_trace(path: &Path, trace: &Trace, meta: &TraceMeta) -> Result<()> {
    let specs: Vec<Value> = trace
        .sites
        .iter()
        .enumerate()
        .map(|(j, s)| {
            let mut v =
                json!({"name": s.spec.name, "param": s.spec.param, "kind": s.spec.kind.name()});
            if let Some(vocab) = s.spec.vocab {
                v["vocab"] = json!(vocab);
            }
            if let Some(Some(d)) = meta.site_compute_dtypes.get(j) {
                v["compute_dtype"] = json!(d.name());
            }
            v
        })
        .collect();
    let mut m = HashMap::new();
    m.insert("format".to_string(), TRACE_FORMAT.to_string());
    m.insert(
        "max_grad_norm".to_string(),
        format!("{:e}", meta.max_grad_norm),
    );
    if let Some(s) = meta.noise_multiplier {
        m.insert("noise_multiplier".to_string(), format!("{s:e}"));
    }
    if let Some(c) = &meta.clipper {
        m.insert("clipper".to_string(), c.clone());
    }
    if let Some(d) = meta.compute_dtype {
        m.insert("compute_dtype".to_string(), d.name().to_string());
    }
    m.insert(
        "sites".to_string(),
        serde_json::to_string(&specs).expect("json"),
    );
    let mut raw = Vec::new();
    for s in &trace.sites {
        let n = &s.spec.name;
        if let Some(a) = &s.activations {
            raw.push((
                format!("{n}.activations"),
                RawTensor::from_f64(&a.view().into_dyn(), meta.dtype),
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
        for (prefix, sums) in [
            ("claimed.clipped_sum.", &step.clipped_sum),
            ("claimed.update.", &step.update),
        ] {
            for (p, v) in sums.iter().flatten() {
                // In the values' own dtype: widening them was exact, so rounding back is too.
                let precision = match v {
                    Floats::F64(_) => Precision::F64,
                    Floats::F32(_) => Precision::F32,
                    Floats::F16(_) => Precision::F16,
                    Floats::Bf16(_) => Precision::BF16,
                };
                let v = Array1::from(v.to_f64_vec()).into_dyn();
                raw.push((
                    format!("{prefix}{p}"),
                    RawTensor::from_f64(&v.view(), precision),
                ));
            }
        }
        if let Some(d) = step.batch_divisor {
            m.insert("batch_divisor".to_string(), format!("{d:e}"));
        }
        m.insert(
            "clip_stabilizer".to_string(),
            format!("{:e}", step.clip_stabilizer),
        );
        m.insert("clipping".to_string(), step.clipping.name().to_string());
    }
    write_raw(path, &raw, Some(m))
}
