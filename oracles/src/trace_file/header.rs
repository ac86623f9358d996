//! The trace file's `__metadata__`: the format, C and σ, the clipper's name, the compute dtype,
//! the sites and the parameter manifest, read and checked before any tensor is (the step's keys
//! are read with the step, in [`super::step`]); and the same header written back.

use super::{MAX_PARAM_ENTRIES, MAX_VOCAB, TRACE_FORMAT, TRACE_FORMAT_CONV, TRACE_FORMAT_SHARED};
use crate::conv::MAX_CONV_ENTRY;
use crate::error::{bail, Error, Result};
use crate::precision::Precision;
use crate::site::{SiteKind, SiteSpec};
use crate::trace::Trace;
use serde::de::{self, DeserializeSeed, MapAccess, Visitor};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt;

/// What `__metadata__` says, checked.
pub(super) struct Header {
    pub max_grad_norm: f64,
    pub noise_multiplier: Option<f64>,
    pub clipper: Option<String>,
    pub compute_dtype: Option<Precision>,
    pub site_compute_dtypes: Vec<Option<Precision>>,
    pub specs: Vec<SiteSpec>,
    /// Per site, its `conv` entry: a convolution stored as its input (format /2 only).
    pub site_convs: Vec<Option<ConvEntry>>,
    /// Per site, the site whose backprops tensor it reads as its own (its `backprops_of`
    /// entry, format /3 only): never itself, never a site that carries one.
    pub site_backprops_of: Vec<Option<String>>,
    /// The `parameters` manifest, when the exporter wrote one.
    pub manifest: Option<BTreeMap<String, usize>>,
}

/// Reads and checks `__metadata__` (the step's keys are [`super::step`]'s).
pub(super) fn read_header(meta: &HashMap<String, String>, label: &str) -> Result<Header> {
    let format = meta_str(meta, "format", label)?;
    if ![TRACE_FORMAT, TRACE_FORMAT_CONV, TRACE_FORMAT_SHARED].contains(&format) {
        bail!("{label}: `__metadata__.format` is {format:?}; this version reads {TRACE_FORMAT:?}, {TRACE_FORMAT_CONV:?} and {TRACE_FORMAT_SHARED:?}");
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
    let mut specs = Vec::new();
    let mut site_compute_dtypes = Vec::new();
    let mut site_convs = Vec::new();
    let mut site_backprops_of = Vec::new();
    for (spec, compute, conv, backprops_of) in parse_specs(meta_str(meta, "sites", label)?, label)?
    {
        if conv.is_some() && format == TRACE_FORMAT {
            bail!(
                "{label}: site `{}` carries `conv` (a convolution stored as its input), which only formats {TRACE_FORMAT_CONV:?} and {TRACE_FORMAT_SHARED:?} have; `__metadata__.format` is {format:?}",
                spec.name
            );
        }
        if backprops_of.is_some() && format != TRACE_FORMAT_SHARED {
            bail!(
                "{label}: site `{}` carries `backprops_of` (its backprops another site's tensor), which only format {TRACE_FORMAT_SHARED:?} has; `__metadata__.format` is {format:?}",
                spec.name
            );
        }
        specs.push(spec);
        site_compute_dtypes.push(compute);
        site_convs.push(conv);
        site_backprops_of.push(backprops_of);
    }
    check_backprops_of(&specs, &site_backprops_of, label)?;
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
        site_convs,
        site_backprops_of,
        manifest,
    })
}

/// Every `backprops_of` names another site of the header that reads its own backprops tensor:
/// one step from a site to the tensor it reads, so no chain or cycle is ever followed.
fn check_backprops_of(specs: &[SiteSpec], of: &[Option<String>], label: &str) -> Result<()> {
    let index: HashMap<&str, usize> = specs
        .iter()
        .enumerate()
        .map(|(j, s)| (s.name.as_str(), j))
        .collect();
    for (spec, other) in specs.iter().zip(of) {
        let Some(other) = other else { continue };
        let n = &spec.name;
        if other == n {
            bail!("{label}: site `{n}`: `backprops_of` names the site itself; a site whose backprops are its own writes `{n}.backprops` and no `backprops_of`");
        }
        let Some(&k) = index.get(other.as_str()) else {
            bail!("{label}: site `{n}`: `backprops_of` names site `{other}`, which `__metadata__.sites` does not list");
        };
        if let Some(further) = &of[k] {
            bail!("{label}: site `{n}`: `backprops_of` names site `{other}`, which itself carries `backprops_of` (`{further}`); a site reads the backprops of a site that holds its own, never through another");
        }
    }
    Ok(())
}

/// A site's `conv` entry: the convolution's geometry, its input's spatial sizes still to come
/// from the `inputs` tensor.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct ConvEntry {
    pub kernel: Vec<usize>,
    pub stride: Vec<usize>,
    pub dilation: Vec<usize>,
    pub padding: Vec<(usize, usize)>,
    pub groups: usize,
}

/// Reads a site's `conv` object: `kernel`, `stride`, `dilation` (lists of n ≥ 1 positive
/// integers), `padding` (n pairs [lo, hi] of integers ≥ 0) and `groups` (a positive integer),
/// nothing else; the lists' agreement with each other and with the inputs is checked with the
/// tensors' shapes.
fn parse_conv(v: &Value, name: &str, label: &str) -> Result<ConvEntry> {
    let at = |key: &str| format!("{label}: site `{name}`: `conv.{key}`");
    let obj = v.as_object().ok_or_else(|| {
        Error::new(format!(
            "{label}: site `{name}`: `conv` must be an object with kernel, stride, dilation, padding and groups, found {v}"
        ))
    })?;
    if let Some(k) = obj
        .keys()
        .find(|k| !["kernel", "stride", "dilation", "padding", "groups"].contains(&k.as_str()))
    {
        bail!("{label}: site `{name}`: `conv` has unknown key `{k}`; expected kernel, stride, dilation, padding and groups");
    }
    let int = |x: &Value, min: u64, key: &str| -> Result<usize> {
        match x.as_u64() {
            Some(n) if n >= min && n <= MAX_CONV_ENTRY as u64 => Ok(n as usize),
            _ => bail!(
                "{}: expected integers in {min}..={MAX_CONV_ENTRY}, found {x}",
                at(key)
            ),
        }
    };
    let list = |key: &str| -> Result<&Vec<Value>> {
        match obj.get(key) {
            Some(Value::Array(a)) if !a.is_empty() => Ok(a),
            Some(x) => bail!("{}: expected a non-empty list, found {x}", at(key)),
            None => bail!("{}: missing", at(key)),
        }
    };
    let positive =
        |key: &str| -> Result<Vec<usize>> { list(key)?.iter().map(|x| int(x, 1, key)).collect() };
    let padding = list("padding")?
        .iter()
        .map(|p| match p.as_array().map(Vec::as_slice) {
            Some([lo, hi]) => Ok((int(lo, 0, "padding")?, int(hi, 0, "padding")?)),
            _ => bail!("{}: expected pairs [lo, hi], found {p}", at("padding")),
        })
        .collect::<Result<Vec<_>>>()?;
    let groups = match obj.get("groups") {
        Some(x) => int(x, 1, "groups")?,
        None => bail!("{}: missing", at("groups")),
    };
    Ok(ConvEntry {
        kernel: positive("kernel")?,
        stride: positive("stride")?,
        dilation: positive("dilation")?,
        padding,
        groups,
    })
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
                Some(c) if c <= MAX_PARAM_ENTRIES => c as usize,
                _ => {
                    return Err(de::Error::custom(format!(
                        "parameter `{name}`: the number of elements must be an integer in 0..={MAX_PARAM_ENTRIES}, found {v}"
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

/// A header number that must be finite and non-negative.
pub(super) fn positive(s: &str, key: &str, label: &str) -> Result<f64> {
    match s.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(v),
        _ => bail!("{label}: `__metadata__.{key}` must be a non-negative number, found {s:?}"),
    }
}

/// A site of `__metadata__.sites`: its spec, its own `compute_dtype`, its `conv` entry and its
/// `backprops_of`.
type SpecEntry = (
    SiteSpec,
    Option<Precision>,
    Option<ConvEntry>,
    Option<String>,
);

fn parse_specs(text: &str, label: &str) -> Result<Vec<SpecEntry>> {
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
            let conv = match s.get("conv") {
                None | Some(Value::Null) => None,
                Some(x) => {
                    if kind != SiteKind::Linear {
                        bail!("{label}: site `{name}` ({}) carries `conv`, which only a convolution's weight, a site of kind `linear`, may", kind.name());
                    }
                    Some(parse_conv(x, &name, label)?)
                }
            };
            let backprops_of = match s.get("backprops_of") {
                None | Some(Value::Null) => None,
                Some(Value::String(other)) => Some(other.clone()),
                Some(x) => bail!("{label}: site `{name}`: `backprops_of` must be the name of another site, found {x}"),
            };
            Ok((SiteSpec { name, param, kind, vocab }, compute, conv, backprops_of))
        })
        .collect()
}

/// The header `write_trace` writes for a trace and what it claims (the step's keys are added
/// with the step).
pub(super) fn written(trace: &Trace, meta: &super::TraceMeta) -> HashMap<String, String> {
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
            if let Some(c) = &s.conv {
                let g = &c.geometry;
                let padding: Vec<[usize; 2]> = g.padding.iter().map(|&(lo, hi)| [lo, hi]).collect();
                v["conv"] = json!({
                    "kernel": g.kernel,
                    "stride": g.stride,
                    "dilation": g.dilation,
                    "padding": padding,
                    "groups": g.groups,
                });
            }
            v
        })
        .collect();
    let mut m = HashMap::new();
    // /1 unless a site needs /2, so a trace without conv-input sites reads in older versions.
    let format = if trace.sites.iter().any(|s| s.conv.is_some()) {
        TRACE_FORMAT_CONV
    } else {
        TRACE_FORMAT
    };
    m.insert("format".to_string(), format.to_string());
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
    m
}
