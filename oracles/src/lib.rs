//! The independent f64 reference of ghost-oracle.
//!
//! It runs a decoder-only language model — HF GPT-2, Llama, Qwen2/3, Gemma 1–3 or VaultGemma, tied
//! or untied — one example at a time, in f64, with an explicit backward pass, and materializes
//! every parameter's per-example gradient. One skeleton (`DecoderModel`) serves every family (one
//! folder each under `families/`); [`load`] reads a checkpoint directory, and a [`Model`] picks
//! the family from `config.json`. From those
//! gradients it reports each example's gradient norm, per-parameter norms and, for a parameter
//! used twice (the tied embedding / LM head), the split ‖g_in‖², ‖g_out‖², ⟨g_in, g_out⟩. It
//! shares no code with the clippers it judges.
//!
//! The concepts, and the files that hold them:
//!
//! ```text
//! model          decoder.rs      the skeleton every family fills in (DecoderModel, ParamSet, Dims;
//! │                              param_set! lists a family's tensors from its field names)
//! ├─ families    families/       one folder a family, each the same files: mod.rs (the model,
//! │                              loaded and saved), config.rs (config.json), params.rs (its
//! │                              tensors in checkpoint order), block.rs (a block's passes and
//! │                              sites); mod.rs the family `model_type` names (Model, ModelConfig)
//! │  ├─ gpt2     families/gpt2/  GPT2LMHeadModel
//! │  └─ llama    families/llama/ Llama, Qwen2, Qwen3, Gemma 1–3, VaultGemma (params.rs: a layer's
//! │                              modules in one table); flavor.rs (what each member changes),
//! │                              gemma_config.rs (Gemma's keys), rope_config.rs (rope_theta /
//! │                              rope_scaling / rope_parameters)
//! ├─ layers      layers.rs       norms, projections, attention, each with its backward;
//! │              matmul.rs (the large f64 products, in faer); sweep.rs (element-wise passes
//! │              over model-sized buffers, on every core)
//! └─ checkpoint  checkpoint.rs   config.json + model.safetensors (load); keys.rs reads the config;
//!                stored.rs (blocks kept in the checkpoint's dtype)
//! batch          batch.rs        ids and labels, checked, and the causal-LM targets
//! reference      gradient.rs     one example's loss and materialized gradient
//!                reference.rs    a batch's norms and tied splits (compute)
//! trace          site.rs         one use of a parameter: its kind, spec and gradient shape
//! ├─ factors     trace.rs        a batch's factors per site, and their brute-force norms;
//! │              conv.rs         a convolution stored as its input and geometry, unfolded an
//! │                              example at a time
//! ├─ shapes      trace_shape.rs  the shapes the factors must have, on dimensions alone
//! └─ file        trace_file/     the trace file (read_trace, write_trace): mod.rs the factors
//!                                and claimed norms, header.rs `__metadata__`, step.rs the
//!                                claimed DP-SGD step
//! clipping       clipping.rs     the clipping rule (flat or automatic), C/(n + γ)
//! formats        precision.rs, tensors.rs (reading safetensors), io.rs (writing it)
//! ```
//!
//! ```
//! use ghost_oracle_reference::{compute, Batch, Gpt2, Gpt2Config, Options};
//! use ndarray::array;
//!
//! let model = Gpt2::random(Gpt2Config::tiny(11, 8, 8, 1, 2), 7, 0.5);
//! let batch = Batch::new(array![[1_i64, 4, 1, 9]], None).unwrap();
//! let r = compute(&model, &batch, &Options::default(), &mut |_| {}).unwrap();
//! let split = r.examples[0].shared[0].1;
//! let wte = r.examples[0].params[0].1;
//! // The tied parameter's norm is the norm of the sum of both uses.
//! let sum_sq = split.input_sq + split.output_sq + 2.0 * split.cross;
//! assert!((wte * wte - sum_sq).abs() <= 1e-12 * sum_sq);
//! ```

mod batch;
mod checkpoint;
mod clipping;
mod conv;
mod decoder;
mod error;
mod factors;
mod families;
mod gradient;
mod io;
mod keys;
mod layers;
mod matmul;
mod precision;
mod reference;
mod rng;
mod site;
mod stored;
mod sweep;
mod tensors;
mod trace;
mod trace_file;
mod trace_shape;

pub use batch::{Batch, IGNORE};
pub use checkpoint::{load, load_resident, Blocks, FromCheckpoint};
pub use clipping::Clipping;
pub use conv::{ConvGeometry, ConvInput, MAX_CONV_ENTRY};
pub use decoder::{BlockParams, DecoderModel, Dims, HasDims, ParamSet, LM_HEAD};
pub use error::{Error, Result};
pub use factors::{Factors, HeldExample, StoredFactors};
pub use families::gpt2::{Gpt2, Gpt2Config, Gpt2Params};
pub use families::llama::{
    LayerType, Llama, LlamaConfig, LlamaFlavor, LlamaLayer, LlamaParams, NormLayout, RopeScaling,
    EMBED_TOKENS,
};
pub use families::{Model, ModelConfig};
pub use gradient::{
    example_gradient, example_gradient_into, example_loss, examples_together, group_norms,
    ExampleNorms, HeadPath, Reduction, SharedSplit, Workspace, MAX_TOGETHER,
};
pub use io::{write_f64_tensors, write_raw, RawTensor};
pub use matmul::{gram, product, product_into, Accumulate};
pub use precision::Precision;
pub use reference::{compute, ExampleReport, Options, Progress, Reference};
pub use rng::SplitMix64;
pub use safetensors::Dtype;
pub use site::{SiteKind, SiteSpec};
pub use stored::StoredBlocks;
pub use tensors::Floats;
pub use trace::{Site, SiteRows, StoredTrace, TiedParameter, Trace};
pub use trace_file::{
    read_stored_trace_bytes_within, read_stored_trace_within, read_trace, read_trace_bytes,
    read_trace_bytes_within, read_trace_within, write_trace, MemoryBudget, ModelRounding,
    ParamValues, StepClaim, TraceMeta, GRADIENT_BLOCK_BYTES,
};
pub use trace_shape::{validate_shapes, ConvShape, IdAt, SiteShape};
