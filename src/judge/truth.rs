//! The truth of a case: every example's norm, the Gram of the true gradients and the gradients
//! themselves, from the reference's materialized f64 gradients (no clipper code).

use crate::error::{Error, Result};
use ghost_oracle_reference::{Reference, Trace as RefTrace};

/// Everything about a case that comes from the reference, not from the clipper.
#[derive(Clone, Debug)]
pub struct Truth {
    pub norms: Vec<f64>,
    /// ⟨g_i*, g_k*⟩ for every pair of examples.
    pub gram: Vec<Vec<f64>>,
    /// Per-example flattened true gradients (reference layout) and that layout.
    pub gradients: Vec<Vec<f64>>,
    pub layout: Vec<(String, Vec<usize>)>,
    /// 2⟨g_in, g_out⟩ / ‖g‖² per example, summed over shared parameters (`None` where ‖g‖ = 0).
    pub cross_share: Vec<Option<f64>>,
}

impl Truth {
    pub fn from_reference(r: &Reference) -> Result<Self> {
        let gram = r
            .gradient_gram()
            .ok_or_else(|| Error::internal("reference ran without gradients"))?;
        let cross_share = r
            .examples
            .iter()
            .map(|e| {
                share(
                    e.shared.iter().map(|(_, s)| 2.0 * s.cross).sum(),
                    e.norm * e.norm,
                )
            })
            .collect();
        let norms = r.examples.iter().map(|e| e.norm).collect();
        let gradients = r.gradients.clone().unwrap_or_default();
        Ok(Truth {
            norms,
            gram,
            gradients,
            layout: r.layout.clone(),
            cross_share,
        })
    }

    /// The truth of any trace, by the reference's brute force: every site's gradient
    /// materialized in f64, sites of a parameter summed (no model needed).
    pub fn from_trace(trace: &RefTrace) -> Result<Self> {
        let params = trace.params();
        let mut gradients = Vec::new();
        let mut layout = Vec::new();
        let mut norms = Vec::new();
        let mut cross_share = Vec::new();
        for i in 0..trace.batch_size() {
            // One pass materializes every site once: the summed gradient of each parameter,
            // and Σ_{j≠k}⟨G_j, G_k⟩ = ‖Σ_j G_j‖² − Σ_j ‖G_j‖² for the cross share.
            let (mut flat, mut total_sq, mut cross) = (Vec::new(), 0.0, 0.0);
            for (param, js) in &params {
                let mut sum: Option<ndarray::Array2<f64>> = None;
                let mut own_sq = 0.0;
                for &j in js {
                    let g = trace.site_gradient(j, i)?;
                    own_sq += g.iter().map(|v| v * v).sum::<f64>();
                    sum = Some(match sum {
                        None => g,
                        Some(acc) if acc.dim() == g.dim() => acc + g,
                        Some(acc) => {
                            return Err(Error::input(format!(
                                "parameter `{param}`: site `{}` writes a {:?} gradient but an earlier site writes {:?}",
                                trace.sites[j].spec.name,
                                g.dim(),
                                acc.dim()
                            )))
                        }
                    });
                }
                let sum = sum.expect("parameter has a site");
                let sq = sum.iter().map(|v| v * v).sum::<f64>();
                total_sq += sq;
                if js.len() > 1 {
                    cross += sq - own_sq;
                }
                if i == 0 {
                    layout.push((param.clone(), sum.shape().to_vec()));
                }
                flat.extend(sum.iter().copied());
            }
            if !total_sq.is_finite() {
                return Err(Error::input(format!(
                    "example {i}: the squared gradient norm overflows f64"
                )));
            }
            norms.push(total_sq.sqrt());
            cross_share.push(share(cross, total_sq));
            gradients.push(flat);
        }
        let gram = gradients
            .iter()
            .map(|a| {
                gradients
                    .iter()
                    .map(|b| a.iter().zip(b).map(|(x, y)| x * y).sum())
                    .collect()
            })
            .collect();
        Ok(Truth {
            norms,
            gram,
            gradients,
            layout,
            cross_share,
        })
    }
}

/// x / n², undefined for a zero gradient.
fn share(x: f64, n2: f64) -> Option<f64> {
    (n2 > 0.0).then(|| x / n2)
}
