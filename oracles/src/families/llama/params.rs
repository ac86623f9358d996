//! The Llama family's parameters: a layer's modules listed once, in [`LAYER`], and everything a
//! checkpoint, a zero gradient or a trace needs to know of them derived from that table.

use super::config::{LlamaConfig, NormLayout};
use crate::decoder::{param_set, BlockParams, LM_HEAD};
use crate::layers::{Linear, RmsNorm};
use ndarray::{Array2, ArrayViewD, ArrayViewMutD};

/// One decoder layer:
/// `h += attn_out_norm(o_proj(attn(rope(q_norm(q)), rope(k_norm(k)), v)))` on
/// `input_layernorm(h)`, then `h += mlp_out_norm(down_proj(act(gate_proj(x)) ⊙ up_proj(x)))` on
/// `x = mlp_norm(h)`; the optional pieces are absent where the flavor has none.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaLayer {
    /// Fixes the checkpoint name of `mlp_norm`.
    pub norm_layout: NormLayout,
    /// RMSNorm before the attention.
    pub input_layernorm: RmsNorm,
    /// Query projection, d → heads·head_dim.
    pub q_proj: Linear,
    /// Key projection, d → key/value heads·head_dim.
    pub k_proj: Linear,
    /// Value projection, d → key/value heads·head_dim.
    pub v_proj: Linear,
    /// `self_attn.q_norm` / `self_attn.k_norm` (Qwen3, Gemma 3): one RMSNorm over head_dim,
    /// applied to every head at every position.
    pub q_norm: Option<RmsNorm>,
    /// The key heads' RMSNorm (see `q_norm`).
    pub k_norm: Option<RmsNorm>,
    /// Attention output projection, heads·head_dim → d.
    pub o_proj: Linear,
    /// `post_attention_layernorm` of the sandwich layout: on the attention's output.
    pub attn_out_norm: Option<RmsNorm>,
    /// The norm before the MLP: `post_attention_layernorm` in the Llama layout,
    /// `pre_feedforward_layernorm` in Gemma 2's and VaultGemma's.
    pub mlp_norm: RmsNorm,
    /// Gated MLP's gate projection, d → intermediate.
    pub gate_proj: Linear,
    /// Gated MLP's up projection, d → intermediate.
    pub up_proj: Linear,
    /// Gated MLP's down projection, intermediate → d.
    pub down_proj: Linear,
    /// `post_feedforward_layernorm` of the sandwich layout: on the MLP's output.
    pub mlp_out_norm: Option<RmsNorm>,
}

/// The weights (or one example's gradient) of a Llama-family model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaParams {
    /// `model.embed_tokens.weight`, V×d.
    pub embed_tokens: Array2<f64>,
    /// The blocks, first layer first (empty when they are stored on disk).
    pub layers: Vec<LlamaLayer>,
    /// `model.norm.weight`.
    pub norm: RmsNorm,
    /// `lm_head.weight` (V×d); `None` for a tied model's weights.
    pub lm_head: Option<Array2<f64>>,
}

/// Checkpoint name of the token embedding.
pub const EMBED_TOKENS: &str = "model.embed_tokens.weight";
pub(super) const FINAL_NORM: &str = "model.norm.weight";

/// A module of a Llama layer: one field of [`LlamaLayer`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Module {
    InputNorm,
    Q,
    K,
    V,
    QNorm,
    KNorm,
    O,
    AttnOutNorm,
    MlpNorm,
    Gate,
    Up,
    Down,
    MlpOutNorm,
}

/// A width of a layer, read from its config.
#[derive(Clone, Copy, Debug)]
enum Width {
    Hidden,
    Intermediate,
    HeadDim,
    /// All query heads: heads × head_dim.
    QueryHeads,
    /// All key (or value) heads: kv_heads × head_dim.
    KvHeads,
}

/// The config switch a linear map's bias follows.
#[derive(Clone, Copy, Debug)]
enum Bias {
    Qkv,
    O,
    Mlp,
}

/// What a module is.
#[derive(Clone, Copy, Debug)]
enum Role {
    /// An RMSNorm over this many features.
    Norm(Width),
    /// A linear map, weight output×input.
    Linear {
        input: Width,
        output: Width,
        bias: Bias,
    },
}

/// Which layers have a module.
#[derive(Clone, Copy, Debug)]
enum Present {
    Always,
    /// Flavors with per-head q/k norms.
    HeadNorms,
    /// Layers of these norm layouts.
    Layouts(&'static [NormLayout]),
}

/// A row of [`LAYER`].
#[derive(Clone, Copy, Debug)]
pub(super) struct LayerModule {
    pub module: Module,
    /// The module path relative to `model.layers.N.`.
    pub name: &'static str,
    role: Role,
    present: Present,
}

const fn norm(module: Module, name: &'static str, width: Width, present: Present) -> LayerModule {
    LayerModule {
        module,
        name,
        role: Role::Norm(width),
        present,
    }
}

const fn linear(
    module: Module,
    name: &'static str,
    input: Width,
    output: Width,
    bias: Bias,
) -> LayerModule {
    LayerModule {
        module,
        name,
        role: Role::Linear {
            input,
            output,
            bias,
        },
        present: Present::Always,
    }
}

const SANDWICH: Present = Present::Layouts(&[NormLayout::Sandwich]);

/// A layer's modules in forward order, named relative to `model.layers.N.`: the order of a
/// layer's tensors in [`BlockParams::tensors`] and in a checkpoint's layout (a weight, then its
/// bias), and of its sites in a trace. HF names the norm before the MLP
/// `post_attention_layernorm` in Llama's layout, where the attention's output has no norm, and
/// `pre_feedforward_layernorm` in the others: two rows, one per layout.
pub(super) const LAYER: [LayerModule; 14] = {
    use Module::*;
    use Width::*;
    [
        norm(InputNorm, "input_layernorm", Hidden, Present::Always),
        linear(Q, "self_attn.q_proj", Hidden, QueryHeads, Bias::Qkv),
        linear(K, "self_attn.k_proj", Hidden, KvHeads, Bias::Qkv),
        linear(V, "self_attn.v_proj", Hidden, KvHeads, Bias::Qkv),
        norm(QNorm, "self_attn.q_norm", HeadDim, Present::HeadNorms),
        norm(KNorm, "self_attn.k_norm", HeadDim, Present::HeadNorms),
        linear(O, "self_attn.o_proj", QueryHeads, Hidden, Bias::O),
        norm(AttnOutNorm, "post_attention_layernorm", Hidden, SANDWICH),
        norm(
            MlpNorm,
            "post_attention_layernorm",
            Hidden,
            Present::Layouts(&[NormLayout::PreNorm]),
        ),
        norm(
            MlpNorm,
            "pre_feedforward_layernorm",
            Hidden,
            Present::Layouts(&[NormLayout::Sandwich, NormLayout::PreFeedforward]),
        ),
        linear(Gate, "mlp.gate_proj", Hidden, Intermediate, Bias::Mlp),
        linear(Up, "mlp.up_proj", Hidden, Intermediate, Bias::Mlp),
        linear(Down, "mlp.down_proj", Intermediate, Hidden, Bias::Mlp),
        norm(MlpOutNorm, "post_feedforward_layernorm", Hidden, SANDWICH),
    ]
};

impl Width {
    fn of(self, cfg: &LlamaConfig) -> usize {
        match self {
            Width::Hidden => cfg.hidden_size,
            Width::Intermediate => cfg.intermediate_size,
            Width::HeadDim => cfg.head_dim,
            Width::QueryHeads => cfg.num_attention_heads * cfg.head_dim,
            Width::KvHeads => cfg.num_key_value_heads * cfg.head_dim,
        }
    }
}

impl Bias {
    fn of(self, cfg: &LlamaConfig) -> bool {
        match self {
            Bias::Qkv => cfg.qkv_bias(),
            Bias::O => cfg.o_proj_bias(),
            Bias::Mlp => cfg.mlp_biases(),
        }
    }
}

impl LayerModule {
    /// Whether a layer of this norm layout may have the module; whether it has one it may have
    /// is for its config to say ([`LayerModule::is_in`]), or its `Option` field.
    pub(super) fn fits(&self, layout: NormLayout) -> bool {
        match self.present {
            Present::Always | Present::HeadNorms => true,
            Present::Layouts(layouts) => layouts.contains(&layout),
        }
    }

    /// Whether a layer of `cfg` has the module.
    fn is_in(&self, cfg: &LlamaConfig) -> bool {
        match self.present {
            Present::Always => true,
            Present::HeadNorms => cfg.flavor.head_norms(),
            Present::Layouts(layouts) => layouts.contains(&cfg.flavor.norm_layout()),
        }
    }

    /// The rows a layer of `cfg` has, in forward order.
    fn of_config(cfg: &LlamaConfig) -> impl Iterator<Item = &'static LayerModule> + '_ {
        LAYER.iter().filter(|row| row.is_in(cfg))
    }

    /// The row of `module` in a layer of `cfg`, if the layer has it.
    fn find(module: Module, cfg: &LlamaConfig) -> Option<&'static LayerModule> {
        Self::of_config(cfg).find(|row| row.module == module)
    }
}

/// (name relative to `model.layers.N.`, shape) of a layer of `cfg`, in [`LAYER`] order.
pub(super) fn layer_layout(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let mut out = Vec::new();
    for row in LayerModule::of_config(cfg) {
        let name = row.name;
        match row.role {
            Role::Norm(width) => out.push((format!("{name}.weight"), vec![width.of(cfg)])),
            Role::Linear {
                input,
                output,
                bias,
            } => {
                let (input, output) = (input.of(cfg), output.of(cfg));
                out.push((format!("{name}.weight"), vec![output, input]));
                if bias.of(cfg) {
                    out.push((format!("{name}.bias"), vec![output]));
                }
            }
        }
    }
    out
}

/// Zero modules of a layer of `cfg`, each shaped by its row of [`LAYER`].
struct ZeroModules<'a>(&'a LlamaConfig);

impl ZeroModules<'_> {
    /// The norm `module`, `None` where a layer of the config has none.
    fn optional_norm(&self, module: Module) -> Option<RmsNorm> {
        let row = LayerModule::find(module, self.0)?;
        match row.role {
            Role::Norm(width) => Some(RmsNorm::zeros(width.of(self.0))),
            Role::Linear { .. } => panic!("LAYER makes {module:?}, a norm, a linear map"),
        }
    }

    fn norm(&self, module: Module) -> RmsNorm {
        self.optional_norm(module)
            .unwrap_or_else(|| panic!("LAYER leaves {module:?}, a norm in every layer, out"))
    }

    fn linear(&self, module: Module) -> Linear {
        let cfg = self.0;
        match LayerModule::find(module, cfg).map(|row| row.role) {
            Some(Role::Linear {
                input,
                output,
                bias,
            }) => Linear::zeros(input.of(cfg), output.of(cfg), bias.of(cfg)),
            Some(Role::Norm(_)) | None => {
                panic!("LAYER does not make {module:?} a linear map of every layer")
            }
        }
    }
}

impl LlamaLayer {
    /// A block of zeros shaped by `cfg`: a zero gradient.
    pub fn zeros(cfg: &LlamaConfig) -> Self {
        let zero = ZeroModules(cfg);
        LlamaLayer {
            norm_layout: cfg.flavor.norm_layout(),
            input_layernorm: zero.norm(Module::InputNorm),
            q_proj: zero.linear(Module::Q),
            k_proj: zero.linear(Module::K),
            v_proj: zero.linear(Module::V),
            q_norm: zero.optional_norm(Module::QNorm),
            k_norm: zero.optional_norm(Module::KNorm),
            o_proj: zero.linear(Module::O),
            attn_out_norm: zero.optional_norm(Module::AttnOutNorm),
            mlp_norm: zero.norm(Module::MlpNorm),
            gate_proj: zero.linear(Module::Gate),
            up_proj: zero.linear(Module::Up),
            down_proj: zero.linear(Module::Down),
            mlp_out_norm: zero.optional_norm(Module::MlpOutNorm),
        }
    }
}

/// A module's parameters as a borrow: a norm (`None` where the layer has none) or a linear map.
enum Part<N, L> {
    Norm(Option<N>),
    Linear(L),
}

/// A layer's tensors in [`LAYER`] order, named relative to `model.layers.N.`. `$view` is `view`
/// or `view_mut`, `$opt` `as_ref` or `as_mut`, so that both borrows are listed by one text; the
/// layer is taken apart into its fields, each handed out once.
macro_rules! layer_tensors {
    ($layer:expr, $view:ident, $opt:ident) => {{
        let LlamaLayer {
            norm_layout,
            input_layernorm,
            q_proj,
            k_proj,
            v_proj,
            q_norm,
            k_norm,
            o_proj,
            attn_out_norm,
            mlp_norm,
            gate_proj,
            up_proj,
            down_proj,
            mlp_out_norm,
        } = $layer;
        let layout = *norm_layout;
        let mut input_layernorm = Some(input_layernorm);
        let mut q_proj = Some(q_proj);
        let mut k_proj = Some(k_proj);
        let mut v_proj = Some(v_proj);
        let mut q_norm = Some(q_norm);
        let mut k_norm = Some(k_norm);
        let mut o_proj = Some(o_proj);
        let mut attn_out_norm = Some(attn_out_norm);
        let mut mlp_norm = Some(mlp_norm);
        let mut gate_proj = Some(gate_proj);
        let mut up_proj = Some(up_proj);
        let mut down_proj = Some(down_proj);
        let mut mlp_out_norm = Some(mlp_out_norm);
        let once = "LAYER has one row per module for each layout";
        let mut out = Vec::new();
        for row in LAYER.iter().filter(|row| row.fits(layout)) {
            let part = match row.module {
                Module::InputNorm => Part::Norm(Some(input_layernorm.take().expect(once))),
                Module::Q => Part::Linear(q_proj.take().expect(once)),
                Module::K => Part::Linear(k_proj.take().expect(once)),
                Module::V => Part::Linear(v_proj.take().expect(once)),
                Module::QNorm => Part::Norm(q_norm.take().expect(once).$opt()),
                Module::KNorm => Part::Norm(k_norm.take().expect(once).$opt()),
                Module::O => Part::Linear(o_proj.take().expect(once)),
                Module::AttnOutNorm => Part::Norm(attn_out_norm.take().expect(once).$opt()),
                Module::MlpNorm => Part::Norm(Some(mlp_norm.take().expect(once))),
                Module::Gate => Part::Linear(gate_proj.take().expect(once)),
                Module::Up => Part::Linear(up_proj.take().expect(once)),
                Module::Down => Part::Linear(down_proj.take().expect(once)),
                Module::MlpOutNorm => Part::Norm(mlp_out_norm.take().expect(once).$opt()),
            };
            let name = row.name;
            match part {
                Part::Norm(Some(n)) => {
                    out.push((format!("{name}.weight"), n.weight.$view().into_dyn()))
                }
                Part::Norm(None) => {}
                Part::Linear(lin) => {
                    out.push((format!("{name}.weight"), lin.weight.$view().into_dyn()));
                    if let Some(b) = lin.bias.$opt() {
                        out.push((format!("{name}.bias"), b.$view().into_dyn()));
                    }
                }
            }
        }
        out
    }};
}

impl BlockParams for LlamaLayer {
    fn tensors(&self) -> Vec<(String, ArrayViewD<'_, f64>)> {
        layer_tensors!(self, view, as_ref)
    }

    fn tensors_mut(&mut self) -> Vec<(String, ArrayViewMutD<'_, f64>)> {
        layer_tensors!(self, view_mut, as_mut)
    }
}

impl LlamaParams {
    /// Zero tensors of `cfg`; with `layers` false the blocks are left out (and the token
    /// embedding too, as a 0×d table, with `table` false).
    pub(super) fn zeros_of(cfg: &LlamaConfig, with_head: bool, layers: bool, table: bool) -> Self {
        let d = cfg.hidden_size;
        LlamaParams {
            embed_tokens: Array2::zeros((if table { cfg.vocab_size } else { 0 }, d)),
            layers: if layers {
                (0..cfg.num_hidden_layers)
                    .map(|_| LlamaLayer::zeros(cfg))
                    .collect()
            } else {
                Vec::new()
            },
            norm: RmsNorm::zeros(d),
            lm_head: with_head.then(|| Array2::zeros((cfg.vocab_size, d))),
        }
    }

    /// Zeros shaped by `cfg`, with an untied head when `with_head`: a zero gradient.
    pub fn zeros(cfg: &LlamaConfig, with_head: bool) -> Self {
        Self::zeros_of(cfg, with_head, true, true)
    }

    /// (checkpoint name, shape) of every tensor of a config, in `tensors()` order, without
    /// allocating.
    pub fn layout(cfg: &LlamaConfig, with_head: bool) -> Vec<(String, Vec<usize>)> {
        let (v, d) = (cfg.vocab_size, cfg.hidden_size);
        let mut out = vec![(EMBED_TOKENS.to_string(), vec![v, d])];
        let layer = layer_layout(cfg);
        for l in 0..cfg.num_hidden_layers {
            out.extend(
                layer
                    .iter()
                    .map(|(n, shape)| (format!("model.layers.{l}.{n}"), shape.clone())),
            );
        }
        out.push((FINAL_NORM.into(), vec![d]));
        if with_head {
            out.push((LM_HEAD.into(), vec![v, d]));
        }
        out
    }
}

param_set!(LlamaParams {
    block: LlamaLayer,
    block_prefix: "model.layers.",
    token_embedding: embed_tokens,
    stem: [(EMBED_TOKENS, embed_tokens)],
    blocks: layers,
    tail: [(FINAL_NORM, norm.weight)],
    lm_head: lm_head,
});
