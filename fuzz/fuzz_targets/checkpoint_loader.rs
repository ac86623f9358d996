//! Arbitrary config.json and model.safetensors: a model or an error, never a panic, and never
//! an allocation sized by the config alone.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // First two bytes: length of the config text; then the config; the rest is the checkpoint.
    if data.len() < 2 {
        return;
    }
    let n = (u16::from_le_bytes([data[0], data[1]]) as usize).min(data.len() - 2);
    let (cfg, weights) = data[2..].split_at(n);
    let Ok(text) = std::str::from_utf8(cfg) else { return };
    let Ok(config) = ghost_oracle_reference::Gpt2Config::from_json_str(text) else { return };
    let _ = ghost_oracle_reference::Gpt2::from_parts(config, weights, "fuzz");
});
