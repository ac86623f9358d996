//! A batch trace on a candle device: for every parameter use (site), the factors a ghost
//! clipper reads. The layout is the trace file's (see docs/trace-format.md): B×T leading.

mod file;

pub use file::{stored_dtype, write_claimed_trace};

use crate::error::{Error, Result};
use candle_core::{DType, Device, Tensor};
pub use ghost_oracle_reference::{SiteKind, SiteSpec};

#[derive(Clone, Debug)]
pub struct Site {
    pub spec: SiteSpec,
    /// B×T×in (linear, conv1d); for layernorm the normalized input x̂.
    pub activations: Option<Tensor>,
    /// B×T ids (u32), for embeddings.
    pub ids: Option<Tensor>,
    /// B×T×out: gradient of each example's own loss with respect to the site's output.
    pub backprops: Tensor,
}

/// The sites that write one parameter (two or more: the parameter is shared).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamSites {
    pub param: String,
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

#[derive(Clone, Debug)]
pub struct Trace {
    pub sites: Vec<Site>,
}

fn array3_to_tensor(a: &ndarray::Array3<f64>, dtype: DType, device: &Device) -> Result<Tensor> {
    let v: Vec<f64> = a.iter().copied().collect();
    Ok(Tensor::from_vec(v, a.dim(), &Device::Cpu)?
        .to_dtype(dtype)?
        .to_device(device)?)
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
                Ok(Site {
                    spec: s.spec.clone(),
                    activations: s
                        .activations
                        .as_ref()
                        .map(|a| array3_to_tensor(a, dtype, device))
                        .transpose()?,
                    ids,
                    backprops: array3_to_tensor(&s.backprops, dtype, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let trace = Trace { sites };
        trace.validate()?;
        Ok(trace)
    }

    pub fn batch_size(&self) -> usize {
        self.sites.first().map_or(0, |s| s.backprops.dims()[0])
    }

    pub fn dtype(&self) -> DType {
        self.sites
            .first()
            .map_or(DType::F32, |s| s.backprops.dtype())
    }

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

    /// Shapes agree within each site and across sites; every site of a parameter produces a
    /// gradient of the same shape. Messages name the site and tensor.
    pub fn validate(&self) -> Result<()> {
        let Some(first) = self.sites.first() else {
            return Err(Error::input("trace has no sites"));
        };
        let (b, t) = dims3(&first.backprops, &first.spec.name, "backprops")?;
        for s in &self.sites {
            let name = &s.spec.name;
            let (sb, st) = dims3(&s.backprops, name, "backprops")?;
            let check_bt = |what: &str, bb: usize, tt: usize| {
                if (bb, tt) != (b, t) {
                    return Err(Error::input(format!(
                        "site `{name}`: `{name}.{what}` is {bb}×{tt} in its leading (batch, sequence) dimensions but site `{}` is {b}×{t}",
                        first.spec.name
                    )));
                }
                Ok(())
            };
            check_bt("backprops", sb, st)?;
            match (&s.activations, s.spec.kind.needs_activations()) {
                (Some(a), true) => {
                    let (ab, at) = dims3(a, name, "activations")?;
                    check_bt("activations", ab, at)?;
                    if s.spec.kind == SiteKind::LayerNorm && a.dims()[2] != s.backprops.dims()[2] {
                        return Err(Error::input(format!(
                            "site `{name}` (layernorm): activations have width {} but backprops {}",
                            a.dims()[2],
                            s.backprops.dims()[2]
                        )));
                    }
                }
                (None, true) => {
                    return Err(Error::input(format!(
                        "site `{name}` ({}): tensor `{name}.activations` is missing",
                        s.spec.kind.name()
                    )))
                }
                _ => {}
            }
            if s.spec.kind.needs_ids() {
                let ids = s.ids.as_ref().ok_or_else(|| {
                    Error::input(format!(
                        "site `{name}` (embedding): tensor `{name}.ids` is missing"
                    ))
                })?;
                let d = ids.dims();
                if d.len() != 2 {
                    return Err(Error::input(format!(
                        "site `{name}`: `{name}.ids` must be 2-D (batch × sequence), found {d:?}"
                    )));
                }
                check_bt("ids", d[0], d[1])?;
                let vocab = s.spec.vocab.ok_or_else(|| {
                    Error::input(format!("site `{name}` (embedding) has no `vocab`"))
                })?;
                let max = ids.flatten_all()?.max(0)?.to_scalar::<u32>()? as usize;
                if max >= vocab {
                    return Err(Error::input(format!("site `{name}`: `{name}.ids` holds id {max}, outside the table's vocab 0..{vocab}")));
                }
            }
        }
        for p in self.params() {
            let shapes: Vec<(usize, usize)> = p
                .sites
                .iter()
                .map(|&j| self.sites[j].gradient_shape())
                .collect();
            for (i, s) in shapes.iter().enumerate().skip(1) {
                if *s != shapes[0] {
                    return Err(Error::input(format!(
                        "parameter `{}`: site `{}` writes a {}×{} gradient but site `{}` writes {}×{}",
                        p.param, self.sites[p.sites[i]].spec.name, s.0, s.1, self.sites[p.sites[0]].spec.name, shapes[0].0, shapes[0].1
                    )));
                }
            }
        }
        Ok(())
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

fn dims3(t: &Tensor, site: &str, what: &str) -> Result<(usize, usize)> {
    match t.dims() {
        [b, tt, _] => Ok((*b, *tt)),
        d => Err(Error::input(format!(
            "site `{site}`: `{site}.{what}` must be 3-D (batch × sequence × features), found {d:?}"
        ))),
    }
}
