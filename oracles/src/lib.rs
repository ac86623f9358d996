//! The independent f64 reference of ghost-oracle.
//!
//! It runs a decoder-only language model — HF GPT-2, Llama or Qwen2, tied or untied — one example
//! at a time, in f64, with an explicit backward pass, and materializes every parameter's
//! per-example gradient. One skeleton (`DecoderModel`) serves every family; `Model::load` picks
//! the family from `config.json`. From those gradients it reports each example's gradient norm,
//! per-parameter norms and, for a parameter used twice (the tied embedding / LM head), the split ‖g_in‖², ‖g_out‖², ⟨g_in, g_out⟩. It shares no code with the
//! clippers it judges.
//!
//! ```
//! use ghost_oracle_reference::{compute, Batch, Gpt2, Gpt2Config, Options};
//! use ndarray::array;
//!
//! let model = Gpt2::random(Gpt2Config::tiny(11, 8, 8, 1, 2), 7, 0.5);
//! let batch = Batch::new(array![[1_i64, 4, 1, 9]], None);
//! let r = compute(&model, &batch, &Options::default(), &mut |_, _| {}).unwrap();
//! let split = r.examples[0].shared[0].1;
//! let wte = r.examples[0].params[0].1;
//! // The tied parameter's norm is the norm of the sum of both uses.
//! let sum_sq = split.input_sq + split.output_sq + 2.0 * split.cross;
//! assert!((wte * wte - sum_sq).abs() <= 1e-12 * sum_sq);
//! ```

mod batch;
mod config;
mod decoder;
mod error;
mod gpt2;
mod gradient;
mod io;
mod layers;
mod llama;
mod llama_config;
mod model;
mod reference;
mod rng;
mod tensors;
mod trace;
mod trace_file;

pub use batch::{Batch, IGNORE};
pub use config::Gpt2Config;
pub use decoder::{DecoderModel, Dims, HasDims, ParamSet, LM_HEAD};
pub use error::{Error, Result};
pub use gpt2::{Block, Gpt2, Gpt2BlockCache, Params};
pub use gradient::{
    example_gradient, example_gradient_into, example_loss, ExampleGradient, HeadPath, Reduction,
    SharedSplit,
};
pub use io::{write_f64_tensors, write_raw, RawTensor};
pub use layers::{Conv1d, LayerNorm, Linear, NormCache, RmsNorm};
pub use llama::{Llama, LlamaBlockCache, LlamaLayer, LlamaParams, EMBED_TOKENS};
pub use llama_config::{LlamaConfig, LlamaFlavor, RopeScaling};
pub use model::{Model, ModelConfig, MODEL_TYPES};
pub use reference::{compute, ExampleReport, ExampleView, Options, Reference, ReferenceModel};
pub use rng::SplitMix64;
pub use safetensors::Dtype;
pub use tensors::{
    parse as parse_safetensors, read_bytes, to_f64 as tensor_f64, to_i64 as tensor_i64,
    MAX_FILE_BYTES,
};
pub use trace::{MaterializedNorm, Site, SiteKind, SiteRecord, SiteSpec, Trace, TraceBuilder};
pub use trace_file::{
    gradient_shape, read_trace, read_trace_bytes, write_trace, TraceMeta, MAX_SITE_ENTRIES,
    MAX_VOCAB, TRACE_FORMAT,
};
