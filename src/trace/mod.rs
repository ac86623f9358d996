//! A batch trace on a candle device: for every parameter use (site), the factors a ghost
//! clipper reads. The layout is the trace file's (see docs/trace-format.md): B×R leading, R each site's own
//! rows per example.

mod file;

pub use file::write_claimed_trace;

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
use ghost_oracle_reference::{validate_shapes, IdAt, SiteShape};
pub use ghost_oracle_reference::{Precision, SiteKind, SiteSpec};

/// The candle dtype a clipper computes in at a precision.
pub fn candle_dtype(p: Precision) -> DType {
    match p {
        Precision::F64 => DType::F64,
        Precision::F32 => DType::F32,
        Precision::F16 => DType::F16,
        Precision::BF16 => DType::BF16,
    }
}

/// The precision of a candle float dtype. Any other dtype is an internal error: no trace or
/// clipper holds factors in it, and guessing a precision would move the judge's bound.
pub fn precision_of(d: DType) -> Result<Precision> {
    match d {
        DType::F64 => Ok(Precision::F64),
        DType::F32 => Ok(Precision::F32),
        DType::F16 => Ok(Precision::F16),
        DType::BF16 => Ok(Precision::BF16),
        other => Err(Error::internal(format!(
            "candle dtype {other:?} is not a precision a trace is computed in"
        ))),
    }
}

/// A per-example vector as f64.
pub fn to_f64_vec(t: &Tensor) -> Result<Vec<f64>> {
    Ok(t.to_dtype(DType::F64)?.to_vec1::<f64>()?)
}

/// A site's factors on the clipper's device: what a ghost clipper reads.
#[derive(Clone, Debug)]
pub struct Site {
    /// Name, parameter and kind.
    pub spec: SiteSpec,
    /// B×R×in (linear, conv1d); for layernorm the normalized input x̂.
    pub activations: Option<Tensor>,
    /// B×R ids (u32), for embeddings.
    pub ids: Option<Tensor>,
    /// B×R×out: gradient of each example's own loss with respect to the site's output.
    pub backprops: Tensor,
}

/// The sites that write one parameter (two or more: the parameter is shared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSites {
    /// The shared parameter's name.
    pub param: String,
    /// Indices into [`Trace::sites`] of the sites that write it, in trace order.
    pub sites: Vec<usize>,
}

impl Site {
    /// The (rows, cols) of the gradient this site writes, in the parameter's layout.
    pub fn gradient_shape(&self) -> (usize, usize) {
        let input = self.activations.as_ref().map_or(0, |a| a.dims()[2]);
        self.spec
            .kind
            .gradient_shape(self.backprops.dims()[2], input, self.spec.vocab)
    }
}

/// A batch's per-site factors, on one device in one dtype.
#[derive(Clone, Debug)]
pub struct Trace {
    /// The sites, in forward order.
    pub sites: Vec<Site>,
}

fn array3_to_tensor(a: &ndarray::Array3<f64>, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f64> = a.iter().copied().collect();
    Ok(Tensor::from_vec(v, a.dim(), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
}

/// A site's factors as B×R×in activations and B×R×out backprops, every example's rows as
/// [`ghost_oracle_reference::Site::rows`] gives them.
fn unfold_site(s: &ghost_oracle_reference::Site) -> (ndarray::Array3<f64>, ndarray::Array3<f64>) {
    let (b, rows) = (s.backprops.dim().0, s.row_count());
    let width = s.input_width().unwrap_or(0);
    let out = s.backprops.dim().2;
    let mut a = ndarray::Array3::zeros((b, rows, width));
    let mut bp = ndarray::Array3::zeros((b, rows, out));
    for i in 0..b {
        let r = s.rows(i);
        if let Some(x) = &r.activations {
            a.index_axis_mut(ndarray::Axis(0), i).assign(x);
        }
        bp.index_axis_mut(ndarray::Axis(0), i).assign(&r.backprops);
    }
    (a, bp)
}

impl Trace {
    /// The reference's f64 trace rounded to `dtype` on `device`.
    pub fn from_reference(
        t: &ghost_oracle_reference::Trace,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let sites = t
            .sites
            .iter()
            .map(|s| {
                let ids = match &s.ids {
                    Some(ids) => {
                        let v = ids
                            .iter()
                            .map(|&x| {
                                u32::try_from(x).map_err(|_| {
                                    Error::input(format!(
                                        "site `{}`: `{}.ids` holds id {x}, outside 0..2³²",
                                        s.spec.name, s.spec.name
                                    ))
                                })
                            })
                            .collect::<Result<Vec<u32>>>()?;
                        Some(Tensor::from_vec(v, ids.dim(), &Device::Cpu)?.to_device(device)?)
                    }
                    None => None,
                };
                // A clipper reads rows: a convolution stored as its input is unfolded here,
                // the whole batch at once, into its /1 twin's factors.
                let unfolded = s.conv.as_ref().map(|_| unfold_site(s));
                let (activations, backprops) = match &unfolded {
                    Some((a, bp)) => (Some(a), bp),
                    None => (s.activations.as_ref(), &s.backprops),
                };
                Ok(Site {
                    spec: s.spec.clone(),
                    activations: activations
                        .map(|a| array3_to_tensor(a, dtype, device))
                        .transpose()?,
                    ids,
                    backprops: array3_to_tensor(backprops, dtype, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let trace = Trace { sites };
        trace.validate()?;
        Ok(trace)
    }

    /// Examples in the batch (0 for a trace without sites).
    pub fn batch_size(&self) -> usize {
        self.sites.first().map_or(0, |s| s.backprops.dims()[0])
    }

    /// The dtype the factors are held in.
    pub fn dtype(&self) -> DType {
        self.sites
            .first()
            .map_or(DType::F32, |s| s.backprops.dtype())
    }

    /// The precision the factors are held in.
    pub fn precision(&self) -> Result<Precision> {
        precision_of(self.dtype())
    }

    /// The device the factors are on.
    pub fn device(&self) -> Device {
        self.sites
            .first()
            .map_or(Device::Cpu, |s| s.backprops.device().clone())
    }

    /// Parameters in first-use order with their sites.
    pub fn params(&self) -> Vec<ParamSites> {
        let mut out: Vec<ParamSites> = Vec::new();
        for (j, s) in self.sites.iter().enumerate() {
            match out.iter_mut().find(|p| p.param == s.spec.param) {
                Some(p) => p.sites.push(j),
                None => out.push(ParamSites {
                    param: s.spec.param.clone(),
                    sites: vec![j],
                }),
            }
        }
        out
    }

    /// Every pair (j, k), j < k, of sites writing the same parameter.
    pub fn shared_pairs(&self) -> Vec<(String, usize, usize)> {
        let mut out = Vec::new();
        for p in self.params() {
            for (a, &j) in p.sites.iter().enumerate() {
                for &k in &p.sites[a + 1..] {
                    out.push((p.param.clone(), j, k));
                }
            }
        }
        out
    }

    /// Shapes agree within each site and across sites, every id is inside its table, and every
    /// site of a parameter produces a gradient of the same shape: the reference's one rule
    /// (`ghost_oracle_reference::validate_shapes`) on the tensors' dimensions. Messages name the
    /// site and tensor.
    pub fn validate(&self) -> Result<()> {
        let id_ranges = self
            .sites
            .iter()
            .map(|s| match &s.ids {
                Some(ids) if ids.rank() == 2 => {
                    let rows = ids.dims()[1];
                    let values = ids.flatten_all()?.to_vec1::<u32>()?;
                    Ok(IdAt::extremes(values.into_iter().map(i64::from), rows))
                }
                _ => Ok(None),
            })
            .collect::<Result<Vec<_>>>()?;
        let shapes: Vec<SiteShape> = self
            .sites
            .iter()
            .zip(id_ranges)
            .map(|(s, id_range)| SiteShape {
                spec: &s.spec,
                backprops: s.backprops.dims(),
                activations: s.activations.as_ref().map(Tensor::dims),
                ids: s.ids.as_ref().map(Tensor::dims),
                id_range,
                conv: None,
            })
            .collect();
        Ok(validate_shapes(&shapes)?)
    }

    /// The same trace in another dtype and on another device.
    pub fn to(&self, dtype: DType, device: &Device) -> Result<Self> {
        let conv = |t: &Tensor| -> Result<Tensor> { Ok(t.to_dtype(dtype)?.to_device(device)?) };
        let sites = self
            .sites
            .iter()
            .map(|s| {
                Ok(Site {
                    spec: s.spec.clone(),
                    activations: s.activations.as_ref().map(conv).transpose()?,
                    ids: s.ids.as_ref().map(|i| i.to_device(device)).transpose()?,
                    backprops: conv(&s.backprops)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Trace { sites })
    }
}
