//! The trace file (docs/trace-format.md): one safetensors file holding every site's factors for a
//! batch, the claimed norms of the clipper under audit, and a `__metadata__` header describing
//! the sites. Everything read from it is checked before it is used: a trace comes from other
//! people's code.

use crate::error::{bail, Error, Result};
use crate::io::{write_raw, RawTensor};
use crate::tensors::{self, has};
use crate::trace::{Site, SiteKind, SiteSpec, Trace};
use ndarray::{Array1, Array3, Ix1, Ix2, Ix3};
use safetensors::Dtype;
use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;
use std::path::Path;

pub const TRACE_FORMAT: &str = "ghost-oracle-trace/1";

/// Embedding tables larger than this (rows) are refused: materializing one per example is the
/// reference's job, and a header must not be able to ask for terabytes.
pub const MAX_VOCAB: usize = 1 << 24;
/// Largest gradient (entries) the reference will materialize for one site: 2²⁷ f64 is 1 GiB,
/// three times GPT-2 XL's embedding. Checked before any allocation, since a small file can
/// declare a huge `vocab`.
pub const MAX_SITE_ENTRIES: usize = 1 << 27;

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
    pub dtype: Dtype,
    /// The precision the model computed in (`__metadata__.compute_dtype`), when the exporter
    /// says. It can be coarser than `dtype`: factors of an f32 model stored as f64 are still
    /// only f32-accurate.
    pub compute_dtype: Option<Dtype>,
}

/// `compute_dtype` values, as written in a trace header.
const COMPUTE_DTYPES: [(&str, Dtype); 4] = [
    ("f64", Dtype::F64),
    ("f32", Dtype::F32),
    ("f16", Dtype::F16),
    ("bf16", Dtype::BF16),
];

fn parse_compute_dtype(s: &str, label: &str) -> Result<Dtype> {
    COMPUTE_DTYPES
        .iter()
        .find(|(name, _)| *name == s)
        .map(|&(_, d)| d)
        .ok_or_else(|| {
            Error::new(format!(
                "{label}: `__metadata__.compute_dtype` is {s:?}; expected one of f64, f32, f16, bf16"
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

fn parse_specs(text: &str, label: &str) -> Result<Vec<SiteSpec>> {
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
                    "{label}: site `{name}` has unknown kind `{kind_s}`; expected linear, conv1d, embedding, bias or layernorm"
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
            Ok(SiteSpec { name, param, kind, vocab })
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
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes)
        .map_err(|e| Error::new(format!("{label} is not a valid safetensors file ({e})")))?;
    let st = tensors::parse(bytes, label)?;
    let meta = header.metadata().clone().unwrap_or_default();
    let format = meta_str(&meta, "format", label)?;
    if format != TRACE_FORMAT {
        bail!("{label}: `__metadata__.format` is {format:?}; this version reads {TRACE_FORMAT:?}");
    }
    let max_grad_norm = positive(
        meta_str(&meta, "max_grad_norm", label)?,
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
    let specs = parse_specs(meta_str(&meta, "sites", label)?, label)?;
    let compute_dtype = meta
        .get("compute_dtype")
        .map(|s| parse_compute_dtype(s, label))
        .transpose()?;
    let manifest = meta
        .get("parameters")
        .map(|text| parse_manifest(text, &specs, label))
        .transpose()?;

    let mut expected: HashSet<String> = HashSet::new();
    let mut bt: Option<(usize, usize, String)> = None;
    let mut dtype = None;
    let mut sites = Vec::with_capacity(specs.len());
    for spec in specs {
        let n = spec.name.clone();
        let tensor3 = |what: &str, expected: &mut HashSet<String>| -> Result<Array3<f64>> {
            let tname = format!("{n}.{what}");
            if !has(&st, &tname) {
                bail!(
                    "{label}: site `{n}` ({}): tensor `{tname}` is missing",
                    spec.kind.name()
                );
            }
            expected.insert(tname.clone());
            let a = tensors::to_f64(&st, &tname, label)?;
            let shape = a.shape().to_vec();
            a.into_dimensionality::<Ix3>()
                .map_err(|_| Error::new(format!("{label}: tensor `{tname}` has shape {shape:?}; expected 3-D (batch × sequence × features)")))
        };
        let backprops = tensor3("backprops", &mut expected)?;
        let bp_name = format!("{n}.backprops");
        let stored = |tname: &str| st.tensor(tname).expect("checked").dtype();
        dtype = Some(coarser(dtype, stored(&bp_name)));
        let (b, t, out) = backprops.dim();
        match &bt {
            None => bt = Some((b, t, n.clone())),
            Some((b0, t0, first)) if (*b0, *t0) != (b, t) => bail!(
                "{label}: site `{n}`: `{bp_name}` is {b}×{t} in batch × sequence but site `{first}` is {b0}×{t0}"
            ),
            _ => {}
        }
        let activations = if spec.kind.needs_activations() {
            let a = tensor3("activations", &mut expected)?;
            if (a.dim().0, a.dim().1) != (b, t) {
                bail!("{label}: site `{n}`: `{n}.activations` is {}×{} in batch × sequence but `{bp_name}` is {b}×{t}", a.dim().0, a.dim().1);
            }
            dtype = Some(coarser(dtype, stored(&format!("{n}.activations"))));
            if spec.kind == SiteKind::LayerNorm && a.dim().2 != out {
                bail!("{label}: site `{n}` (layernorm): `{n}.activations` has width {} but `{bp_name}` {out}", a.dim().2);
            }
            Some(a)
        } else {
            None
        };
        let ids = if spec.kind.needs_ids() {
            let tname = format!("{n}.ids");
            if !has(&st, &tname) {
                bail!("{label}: site `{n}` (embedding): tensor `{tname}` is missing");
            }
            expected.insert(tname.clone());
            let ids = tensors::to_i64(&st, &tname, label)?;
            let shape = ids.shape().to_vec();
            let ids = ids.into_dimensionality::<Ix2>().map_err(|_| {
                Error::new(format!(
                    "{label}: `{tname}` has shape {shape:?}; expected batch × sequence"
                ))
            })?;
            if ids.dim() != (b, t) {
                bail!(
                    "{label}: site `{n}`: `{tname}` is {:?} but `{bp_name}` is {b}×{t}",
                    ids.dim()
                );
            }
            let vocab = spec.vocab.expect("checked");
            if let Some(((i, tt), x)) = ids
                .indexed_iter()
                .find(|(_, &x)| x < 0 || x as usize >= vocab)
            {
                bail!("{label}: site `{n}`: `{tname}`[{i}][{tt}] = {x} is outside the table's vocab 0..{vocab}");
            }
            Some(ids)
        } else {
            None
        };
        let site = Site {
            spec,
            activations,
            ids,
            backprops,
        };
        let (rows, cols) = gradient_shape(&site);
        if rows.saturating_mul(cols) > MAX_SITE_ENTRIES {
            bail!("{label}: site `{n}` writes a {rows}×{cols} gradient; at most {MAX_SITE_ENTRIES} entries are materialized");
        }
        if let Some(&count) = manifest.as_ref().and_then(|m| m.get(&site.spec.param)) {
            if rows * cols != count {
                bail!(
                    "{label}: site `{n}` writes a {rows}×{cols} gradient ({} entries) but `__metadata__.parameters` lists parameter `{}` with {count} elements",
                    rows * cols,
                    site.spec.param
                );
            }
        }
        sites.push(site);
    }
    let (b, _, _) = bt.expect("at least one site");
    let trace = Trace { sites };
    for (param, js) in trace.params() {
        let shapes: Vec<(usize, usize)> = js
            .iter()
            .map(|&j| gradient_shape(&trace.sites[j]))
            .collect();
        if let Some(k) = shapes.iter().position(|s| *s != shapes[0]) {
            bail!(
                "{label}: parameter `{param}`: site `{}` writes a {}×{} gradient but site `{}` writes {}×{}",
                trace.sites[js[k]].spec.name,
                shapes[k].0,
                shapes[k].1,
                trace.sites[js[0]].spec.name,
                shapes[0].0,
                shapes[0].1
            );
        }
    }
    // Claims may be NaN or infinite: that is the clipper's defect, judged as a verdict.
    let vector = |name: &str, expected: &mut HashSet<String>| -> Result<Vec<f64>> {
        expected.insert(name.to_string());
        let a = tensors::to_f64_unchecked(&st, name, label)?;
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
    if !has(&st, "claimed.norms") {
        bail!(
            "{label}: tensor `claimed.norms` is missing (the per-example norms the clipper used)"
        );
    }
    let claimed_norms = vector("claimed.norms", &mut expected)?;
    let claimed_coefficients = if has(&st, "claimed.coefficients") {
        Some(vector("claimed.coefficients", &mut expected)?)
    } else {
        None
    };
    for name in st.names() {
        if !expected.contains(name) {
            bail!("{label}: unexpected tensor `{name}` (no site in `__metadata__.sites` reads it)");
        }
    }
    let meta = TraceMeta {
        max_grad_norm,
        noise_multiplier,
        clipper: meta.get("clipper").cloned(),
        claimed_norms,
        claimed_coefficients,
        dtype: dtype.expect("at least one site"),
        compute_dtype,
    };
    Ok((trace, meta))
}

/// (rows, cols) of the gradient a site writes, in the parameter's layout.
pub fn gradient_shape(site: &Site) -> (usize, usize) {
    let inp = site.activations.as_ref().map_or(0, |a| a.dim().2);
    site.spec
        .kind
        .gradient_shape(site.backprops.dim().2, inp, site.spec.vocab)
}

/// The less precise of two stored float dtypes (a trace is only as accurate as its coarsest
/// factor): f64 < f32 < f16 < bf16 by unit roundoff.
fn coarser(a: Option<Dtype>, b: Dtype) -> Dtype {
    let rank = |d: Dtype| match d {
        Dtype::F64 => 0,
        Dtype::F32 => 1,
        Dtype::F16 => 2,
        _ => 3,
    };
    match a {
        Some(a) if rank(a) >= rank(b) => a,
        _ => b,
    }
}

/// Writes a trace file; factor tensors in `dtype`, claims in f64.
pub fn write_trace(path: &Path, trace: &Trace, meta: &TraceMeta) -> Result<()> {
    let specs: Vec<Value> = trace
        .sites
        .iter()
        .map(|s| {
            let mut v =
                json!({"name": s.spec.name, "param": s.spec.param, "kind": s.spec.kind.name()});
            if let Some(vocab) = s.spec.vocab {
                v["vocab"] = json!(vocab);
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
        let Some((name, _)) = COMPUTE_DTYPES.iter().find(|(_, x)| *x == d) else {
            bail!(
                "cannot write {}: compute_dtype {d:?} is not one of f64, f32, f16, bf16",
                path.display()
            );
        };
        m.insert("compute_dtype".to_string(), name.to_string());
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
        RawTensor::from_f64(&norms.view(), Dtype::F64),
    ));
    if let Some(c) = &meta.claimed_coefficients {
        let c = Array1::from(c.clone()).into_dyn();
        raw.push((
            "claimed.coefficients".to_string(),
            RawTensor::from_f64(&c.view(), Dtype::F64),
        ));
    }
    write_raw(path, &raw, Some(m))
}
