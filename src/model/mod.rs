//! GPT-2 on candle: a second, independent implementation of the model (autograd instead of the
//! reference's hand-written backward) that produces a batch trace in any dtype, on any device.
//! Backprops are read from "taps": a zero `Var` added to each site's output, whose gradient is
//! the gradient of that output.

use crate::error::{Error, Result};
use crate::trace::{Site, SiteKind, SiteSpec, Trace};
use candle_core::{DType, Device, Tensor, Var, D};
use ghost_oracle_reference::{Batch, Gpt2, Gpt2Config, Reduction, IGNORE, LM_HEAD};

pub struct CandleGpt2 {
    config: Gpt2Config,
    /// (checkpoint name, weight) in the reference's parameter order.
    weights: Vec<(String, Var)>,
    prefix: String,
    head_param: String,
    dtype: DType,
    device: Device,
}

/// The trace of a batch and the batch gradient Σ_i ∇L_i of every parameter.
pub struct Extracted {
    pub trace: Trace,
    pub batch_gradient: Vec<(String, Tensor)>,
    pub losses: Vec<f64>,
}

struct Taps {
    sites: Vec<(SiteSpec, Option<Tensor>, Option<Tensor>, Var)>,
}

impl Taps {
    /// Adds a zero tap to `out` and records the site (and, for a weight with a bias, the bias
    /// site that shares the same backprops).
    fn tap(
        &mut self,
        out: Tensor,
        spec: SiteSpec,
        activations: Option<Tensor>,
        ids: Option<Tensor>,
    ) -> Result<Tensor> {
        let var = Var::zeros(out.shape(), out.dtype(), out.device())?;
        let tapped = (out + var.as_tensor())?;
        self.sites.push((spec, activations, ids, var));
        Ok(tapped)
    }
}

fn spec(name: String, kind: SiteKind) -> SiteSpec {
    SiteSpec {
        param: name.clone(),
        name,
        kind,
        vocab: None,
    }
}

impl CandleGpt2 {
    pub fn from_reference(model: &Gpt2, dtype: DType, device: &Device) -> Result<Self> {
        let weights = model
            .params
            .tensors()
            .into_iter()
            .map(|(local, t)| {
                let v: Vec<f64> = t.iter().copied().collect();
                let tensor = Tensor::from_vec(v, t.shape(), &Device::Cpu)?
                    .to_dtype(dtype)?
                    .to_device(device)?;
                Ok((model.param_name(&local), Var::from_tensor(&tensor)?))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(CandleGpt2 {
            config: model.config.clone(),
            weights,
            prefix: model.prefix.clone(),
            head_param: model.head_param_name(),
            dtype,
            device: device.clone(),
        })
    }

    fn w(&self, local: &str) -> Result<&Tensor> {
        let name = if local == LM_HEAD {
            local.to_string()
        } else {
            format!("{}{local}", self.prefix)
        };
        self.weights
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_tensor())
            .ok_or_else(|| Error::internal(format!("weight `{name}` not found")))
    }

    fn name(&self, local: &str) -> String {
        format!("{}{local}", self.prefix)
    }

    fn layernorm(&self, x: &Tensor, local: &str, taps: &mut Taps) -> Result<(Tensor, Tensor)> {
        let mean = x.mean_keepdim(D::Minus1)?;
        let centered = x.broadcast_sub(&mean)?;
        let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
        let xhat = centered.broadcast_div(&(var + self.config.layer_norm_epsilon)?.sqrt()?)?;
        let (w, b) = (
            self.w(&format!("{local}.weight"))?,
            self.w(&format!("{local}.bias"))?,
        );
        let out = xhat.broadcast_mul(w)?.broadcast_add(b)?;
        let out = taps.tap(
            out,
            spec(self.name(&format!("{local}.weight")), SiteKind::LayerNorm),
            Some(xhat.detach()),
            None,
        )?;
        Ok((xhat, out))
    }

    fn conv1d(&self, x: &Tensor, local: &str, taps: &mut Taps) -> Result<Tensor> {
        let out = x
            .broadcast_matmul(self.w(&format!("{local}.weight"))?)?
            .broadcast_add(self.w(&format!("{local}.bias"))?)?;
        taps.tap(
            out,
            spec(self.name(&format!("{local}.weight")), SiteKind::Conv1d),
            Some(x.detach()),
            None,
        )
    }

    /// gelu_new written from primitive ops (candle's built-in backward rounds its constants).
    fn gelu_new(x: &Tensor) -> Result<Tensor> {
        let c = (2.0 / std::f64::consts::PI).sqrt();
        let inner = ((x + (x.sqr()? * x)?.affine(0.044715, 0.0)?)?.affine(c, 0.0)?).tanh()?;
        Ok(((inner + 1.0)? * x)?.affine(0.5, 0.0)?)
    }

    /// Runs the batch forward and backward (of the summed per-example losses) and returns the
    /// trace in this model's dtype and device.
    pub fn extract(&self, batch: &Batch, reduction: Reduction) -> Result<Extracted> {
        batch.validate(&self.config, "batch")?;
        let cfg = &self.config;
        let (b, t, d, h, hd) = (
            batch.len(),
            batch.seq_len(),
            cfg.n_embd,
            cfg.n_head,
            cfg.head_dim(),
        );
        let dev = &self.device;
        let ids_u32: Vec<u32> = batch.input_ids.iter().map(|&x| x as u32).collect();
        let ids = Tensor::from_vec(ids_u32, (b, t), dev)?;
        let pos = Tensor::arange(0u32, t as u32, dev)?;
        let mut taps = Taps { sites: Vec::new() };

        let tok = self
            .w("wte.weight")?
            .index_select(&ids.flatten_all()?, 0)?
            .reshape((b, t, d))?;
        let x = tok.broadcast_add(&self.w("wpe.weight")?.index_select(&pos, 0)?)?;
        let var = Var::zeros(x.shape(), self.dtype, dev)?;
        let mut x = (x + var.as_tensor())?;
        let emb_tap = var;

        let mask: Vec<f64> = (0..t * t)
            .map(|k| if k % t > k / t { -1e30 } else { 0.0 })
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), dev)?.to_dtype(self.dtype)?;
        let mut layer_scale = 1.0;
        for l in 0..cfg.n_layer {
            let p = |s: &str| format!("h.{l}.{s}");
            let (_, a1) = self.layernorm(&x, &p("ln_1"), &mut taps)?;
            let qkv = self.conv1d(&a1, &p("attn.c_attn"), &mut taps)?;
            let heads = |k: usize| -> Result<Tensor> {
                Ok(qkv
                    .narrow(2, k * d, d)?
                    .reshape((b, t, h, hd))?
                    .transpose(1, 2)?
                    .contiguous()?)
            };
            let (q, k, v) = (heads(0)?, heads(1)?, heads(2)?);
            if cfg.scale_attn_by_inverse_layer_idx {
                layer_scale = 1.0 / (l + 1) as f64;
            }
            let scale = if cfg.scale_attn_weights {
                layer_scale / (hd as f64).sqrt()
            } else {
                layer_scale
            };
            let scores =
                (q.matmul(&k.transpose(2, 3)?.contiguous()?)? * scale)?.broadcast_add(&mask)?;
            let m = scores.max_keepdim(D::Minus1)?.detach();
            let e = scores.broadcast_sub(&m)?.exp()?;
            let probs = e.broadcast_div(&e.sum_keepdim(D::Minus1)?)?;
            let y = probs
                .matmul(&v)?
                .transpose(1, 2)?
                .contiguous()?
                .reshape((b, t, d))?;
            x = (x + self.conv1d(&y, &p("attn.c_proj"), &mut taps)?)?;
            let (_, a2) = self.layernorm(&x, &p("ln_2"), &mut taps)?;
            let f_pre = self.conv1d(&a2, &p("mlp.c_fc"), &mut taps)?;
            let f = Self::gelu_new(&f_pre)?;
            x = (x + self.conv1d(&f, &p("mlp.c_proj"), &mut taps)?)?;
        }
        let (_, af) = self.layernorm(&x, "ln_f", &mut taps)?;
        let head_w = if cfg.tie_word_embeddings {
            self.w("wte.weight")?
        } else {
            self.w(LM_HEAD)?
        };
        let logits = af.broadcast_matmul(&head_w.t()?)?;
        let mut head_spec = spec(LM_HEAD.to_string(), SiteKind::Linear);
        head_spec.param = self.head_param.clone();
        let logits = taps.tap(logits, head_spec, Some(af.detach()), None)?;

        // Per-example loss: weights w_bt = 1/N_b (mean) or 1 (sum) on kept targets.
        let mut weights = vec![0.0; b * t];
        let mut targets = vec![0u32; b * t];
        for i in 0..b {
            let tg = batch.targets(i);
            let w = match reduction {
                Reduction::Mean => 1.0 / tg.len() as f64,
                Reduction::Sum => 1.0,
            };
            for (pos, y) in tg {
                weights[i * t + pos] = w;
                targets[i * t + pos] = y as u32;
            }
        }
        debug_assert!(batch.labels.iter().all(|&y| y == IGNORE || y >= 0));
        let weights = Tensor::from_vec(weights, (b, t), dev)?.to_dtype(self.dtype)?;
        let targets = Tensor::from_vec(targets, (b, t, 1), dev)?;
        let m = logits.max_keepdim(D::Minus1)?.detach();
        let lse = (logits
            .broadcast_sub(&m)?
            .exp()?
            .sum_keepdim(D::Minus1)?
            .log()?
            + &m)?
            .squeeze(2)?;
        let picked = logits.gather(&targets, 2)?.squeeze(2)?;
        let per_token = ((lse - picked)? * &weights)?;
        let losses = per_token.sum(1)?;
        let grads = losses.sum_all()?.backward()?;

        let bp = |v: &Var| -> Result<Tensor> {
            Ok(match grads.get(v.as_tensor()) {
                Some(g) => g.clone(),
                None => v.as_tensor().zeros_like()?,
            })
        };
        let emb_bp = bp(&emb_tap)?;
        let mut sites = vec![
            Site {
                spec: SiteSpec {
                    name: self.name("wte.weight"),
                    param: self.name("wte.weight"),
                    kind: SiteKind::Embedding,
                    vocab: Some(cfg.vocab_size),
                },
                activations: None,
                ids: Some(ids.clone()),
                backprops: emb_bp.clone(),
            },
            Site {
                spec: SiteSpec {
                    name: self.name("wpe.weight"),
                    param: self.name("wpe.weight"),
                    kind: SiteKind::Embedding,
                    vocab: Some(cfg.n_positions),
                },
                activations: None,
                ids: Some(pos.unsqueeze(0)?.broadcast_as((b, t))?.contiguous()?),
                backprops: emb_bp,
            },
        ];
        for (spec, activations, ids, var) in &taps.sites {
            let backprops = bp(var)?;
            let with_bias = matches!(spec.kind, SiteKind::Conv1d | SiteKind::LayerNorm);
            sites.push(Site {
                spec: spec.clone(),
                activations: activations.clone(),
                ids: ids.clone(),
                backprops: backprops.clone(),
            });
            if with_bias {
                let bias = spec.name.trim_end_matches(".weight").to_string() + ".bias";
                sites.push(Site {
                    spec: SiteSpec {
                        name: bias.clone(),
                        param: bias,
                        kind: SiteKind::Bias,
                        vocab: None,
                    },
                    activations: None,
                    ids: None,
                    backprops,
                });
            }
        }
        let batch_gradient = self
            .weights
            .iter()
            .map(|(n, v)| Ok((n.clone(), bp(v)?)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Extracted {
            trace: Trace { sites },
            batch_gradient,
            losses: crate::clippers::gram::to_f64_vec(&losses)?,
        })
    }
}
