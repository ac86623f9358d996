//! The shapes a trace's factors must have, checked on their dimensions alone, so that the
//! reference's arrays, a trace file's tensors and a clipper's device tensors are held to one
//! rule with one set of messages.

use crate::conv::ConvGeometry;
use crate::error::{bail, Error, Result};
use crate::site::{SiteKind, SiteSpec};
use std::collections::HashMap;

/// An id of an `ids` tensor and where it first occurs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IdAt {
    /// The id.
    pub id: i64,
    /// The example it occurs in.
    pub example: usize,
    /// The row of the example's ids (a token's position; a bag member for an embedding bag).
    pub row: usize,
}

impl IdAt {
    /// The smallest and the largest of B×R ids given in row-major order (`rows` = R, the site's
    /// rows per example), each where it first occurs; `None` when there are none.
    pub fn extremes(ids: impl IntoIterator<Item = i64>, rows: usize) -> Option<(IdAt, IdAt)> {
        let rows = rows.max(1);
        let mut out: Option<(IdAt, IdAt)> = None;
        for (k, id) in ids.into_iter().enumerate() {
            let at = IdAt {
                id,
                example: k / rows,
                row: k % rows,
            };
            match &mut out {
                None => out = Some((at, at)),
                Some((lo, hi)) => {
                    if id < lo.id {
                        *lo = at;
                    }
                    if id > hi.id {
                        *hi = at;
                    }
                }
            }
        }
        out
    }
}

/// One site's factors as dimensions: what [`validate_shapes`] checks. R, the site's rows per
/// example, is its own: T for a token-wise layer, k·T for a per-head norm, the output positions of
/// a convolution, the members of a bag, 1 for a pooled head.
#[derive(Clone, Copy, Debug)]
pub struct SiteShape<'a> {
    /// The site's name, parameter and kind.
    pub spec: &'a SiteSpec,
    /// B×R×out.
    pub backprops: &'a [usize],
    /// B×R×in, for the kinds that read their input; `None` when absent.
    pub activations: Option<&'a [usize]>,
    /// B×R, for embeddings; `None` when absent.
    pub ids: Option<&'a [usize]>,
    /// The smallest and the largest id ([`IdAt::extremes`]), when the site has ids.
    pub id_range: Option<(IdAt, IdAt)>,
    /// A convolution stored as its input (format /2): its geometry and the inputs' dimensions.
    pub conv: Option<ConvShape<'a>>,
}

/// A convolution stored as its input, as dimensions.
#[derive(Clone, Copy, Debug)]
pub struct ConvShape<'a> {
    /// Kernel, stride, dilation, padding, groups and the input's spatial sizes.
    pub geometry: &'a ConvGeometry,
    /// B × C_in × ∏S_d (the spatial axes flattened).
    pub inputs: &'a [usize],
}

impl ConvShape<'_> {
    /// C_in/g · ∏k, the columns of the weight's gradient (0 for dimensions not yet validated).
    fn patch_width(&self) -> usize {
        let channels = self.inputs.get(1).copied().unwrap_or(0);
        let kernel = self
            .geometry
            .kernel
            .iter()
            .fold(1usize, |a, &k| a.saturating_mul(k));
        (channels / self.geometry.groups.max(1)).saturating_mul(kernel)
    }
}

impl SiteShape<'_> {
    /// (rows, cols) of the gradient the site writes, in the parameter's layout (meaningful once
    /// the shapes are validated).
    pub fn gradient_shape(&self) -> (usize, usize) {
        let width = |d: Option<&[usize]>| d.and_then(|d| d.get(2)).copied().unwrap_or(0);
        let input = match &self.conv {
            Some(c) => c.patch_width(),
            None => width(self.activations),
        };
        self.spec
            .kind
            .gradient_shape(width(Some(self.backprops)), input, self.spec.vocab)
    }
}

/// Checks that a trace's factors fit together: every factor has the rank its kind reads, every
/// site the batch B of the first, each site's factors one row count R ≥ 1 of its own (its
/// activations, backprops and ids all B×R), a layernorm's input the width of its output, every
/// id inside its table, and every site of a parameter a gradient of one shape. The first
/// inconsistency is the error, naming the site and the tensor.
///
/// Sites need not agree on R: a site's gradient is a sum over its own rows, and two uses of one
/// parameter with R and S rows meet in an R×S Gram (a head on one pooled row tied to an
/// embedding on T tokens, an RNN cell's weight at every step).
pub fn validate_shapes(sites: &[SiteShape<'_>]) -> Result<()> {
    let Some(first) = sites.first() else {
        bail!("trace has no sites");
    };
    let [batch, _, _] = dims3(first.backprops, &format!("{}.backprops", first.spec.name))?;
    for s in sites {
        check_site(s, (first.spec.name.as_str(), batch))?;
    }
    check_parameters(sites)
}

/// One site's checks; `first` is the name and batch of the site the others are held to.
fn check_site(s: &SiteShape<'_>, (first, batch): (&str, usize)) -> Result<()> {
    let n = &s.spec.name;
    let kind = s.spec.kind;
    let bp = format!("{n}.backprops");
    let [b, rows, out] = dims3(s.backprops, &bp)?;
    if b != batch {
        bail!("site `{n}`: `{bp}` is {b}×{rows}×{out} in batch × rows × features but site `{first}` has batch {batch}; every site holds the same examples");
    }
    if rows == 0 {
        bail!(
            "site `{n}`: `{bp}` is {b}×0×{out}: no rows; a site has at least one row per example"
        );
    }
    if let Some(c) = &s.conv {
        return check_conv(s, c, [b, rows, out]);
    }
    if kind.needs_activations() {
        let an = format!("{n}.activations");
        let Some(a) = s.activations else {
            bail!("site `{n}` ({}): tensor `{an}` is missing", kind.name());
        };
        let [ab, ar, width] = dims3(a, &an)?;
        if (ab, ar) != (b, rows) {
            bail!("site `{n}`: `{an}` is {ab}×{ar} in batch × rows but `{bp}` is {b}×{rows}");
        }
        if kind == SiteKind::LayerNorm && width != out {
            bail!("site `{n}` (layernorm): `{an}` has width {width} but `{bp}` {out}");
        }
    }
    if kind.needs_ids() {
        let idn = format!("{n}.ids");
        let Some(d) = s.ids else {
            bail!("site `{n}` ({}): tensor `{idn}` is missing", kind.name());
        };
        if d.len() != 2 {
            bail!("`{idn}` has shape {d:?}; expected batch × rows");
        }
        if (d[0], d[1]) != (b, rows) {
            bail!(
                "site `{n}`: `{idn}` is {}×{} in batch × rows but `{bp}` is {b}×{rows}",
                d[0],
                d[1]
            );
        }
        let vocab = s.spec.vocab.ok_or_else(|| {
            Error::new(format!(
                "site `{n}` ({}) needs `vocab`, the number of rows of its table",
                kind.name()
            ))
        })?;
        if let Some((lo, hi)) = s.id_range {
            let table = i64::try_from(vocab).unwrap_or(i64::MAX);
            let outside = if lo.id < 0 {
                Some(lo)
            } else {
                (hi.id >= table).then_some(hi)
            };
            if let Some(x) = outside {
                bail!(
                    "site `{n}`: `{idn}`[{}][{}] = {} is outside the table's vocab 0..{vocab}",
                    x.example,
                    x.row,
                    x.id
                );
            }
        }
    }
    Ok(())
}

/// A convolution stored as its input (format /2, docs/trace-format.md): a `linear` site with no
/// `activations` or `ids`, a consistent geometry, C_in and C_out divisible by the groups, the
/// inputs of the batch, and one row of backprops per output position.
fn check_conv(s: &SiteShape<'_>, c: &ConvShape<'_>, [b, rows, out]: [usize; 3]) -> Result<()> {
    let n = &s.spec.name;
    let kind = s.spec.kind;
    let inp = format!("{n}.inputs");
    let bp = format!("{n}.backprops");
    match kind {
        SiteKind::Linear => {}
        SiteKind::Conv1d | SiteKind::Embedding | SiteKind::Bias | SiteKind::LayerNorm => bail!(
            "site `{n}` ({}): `conv` is only for a convolution's weight, a site of kind `linear`",
            kind.name()
        ),
    }
    if s.activations.is_some() {
        bail!("site `{n}`: tensor `{n}.activations` is given but the site is stored as its convolution's input (`conv`, tensor `{inp}`); a site holds one or the other");
    }
    if s.ids.is_some() {
        bail!("site `{n}`: tensor `{n}.ids` is given but a convolution reads no ids");
    }
    let g = c.geometry;
    let positions = g
        .positions()
        .map_err(|e| Error::new(format!("site `{n}`: `conv`: {e}")))?;
    let [ib, c_in, spatial] = match *c.inputs {
        [ib, c_in, spatial] => [ib, c_in, spatial],
        _ => bail!(
            "tensor `{inp}` has shape {:?}; expected batch × channels × spatial",
            c.inputs
        ),
    };
    if ib != b {
        bail!("site `{n}`: `{inp}` holds {ib} examples but `{bp}` {b}");
    }
    if spatial != g.input_volume() {
        bail!(
            "site `{n}`: `{inp}` holds {spatial} values a channel but its spatial sizes {:?} make {}",
            g.input_size,
            g.input_volume()
        );
    }
    if c_in == 0 || c_in % g.groups != 0 {
        bail!(
            "site `{n}`: `{inp}` has {c_in} channels, not a positive multiple of `conv.groups` = {}",
            g.groups
        );
    }
    if out % g.groups != 0 {
        bail!(
            "site `{n}`: `{bp}` has {out} output channels, not a multiple of `conv.groups` = {}",
            g.groups
        );
    }
    if rows != positions {
        bail!(
            "site `{n}`: `{bp}` has {rows} rows but the geometry gives {positions} output positions ({:?})",
            g.output_size().unwrap_or_default()
        );
    }
    Ok(())
}

/// Every site of a parameter writes a gradient of the same shape (parameters in first-use order).
fn check_parameters(sites: &[SiteShape<'_>]) -> Result<()> {
    let mut order: Vec<(&str, Vec<usize>)> = Vec::new();
    let mut index: HashMap<&str, usize> = HashMap::new();
    for (j, s) in sites.iter().enumerate() {
        let param = s.spec.param.as_str();
        match index.get(param) {
            Some(&k) => order[k].1.push(j),
            None => {
                index.insert(param, order.len());
                order.push((param, vec![j]));
            }
        }
    }
    for (param, js) in order {
        let shape0 = sites[js[0]].gradient_shape();
        for &j in &js[1..] {
            let shape = sites[j].gradient_shape();
            if shape != shape0 {
                bail!(
                    "parameter `{param}`: site `{}` writes a {}×{} gradient but site `{}` writes {}×{}",
                    sites[j].spec.name,
                    shape.0,
                    shape.1,
                    sites[js[0]].spec.name,
                    shape0.0,
                    shape0.1
                );
            }
        }
    }
    Ok(())
}

fn dims3(d: &[usize], tensor: &str) -> Result<[usize; 3]> {
    match *d {
        [b, t, w] => Ok([b, t, w]),
        _ => bail!("tensor `{tensor}` has shape {d:?}; expected 3-D (batch × rows × features)"),
    }
}
