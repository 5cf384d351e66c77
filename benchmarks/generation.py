"""Models scored by `generate`: encoder-decoders (BART, T5, Marian, Whisper) and a decoder-only LM (Qwen2), small
random-weight configs of transformers' own classes (no hub here). The eval_fn is the share of greedily generated
tokens (8 new, no early stop) equal to the fp32 model's; the tuner runs its default config (int8 / bf16 / fp32,
tolerance 0.01 relative). Then whole `generate` calls of fp32, the tuned model and torch's quantize_dynamic (every
Linear, int8) are timed interleaved, the way the user runs them.

    .venv/bin/python benchmarks/generation.py --models bart,t5,marian,whisper,qwen2
"""
from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from pathlib import Path

import torch
import transformers

from autotune import MixedPrecisionConfig, TuningConfig, autotune

SMALL = dict(d_model=256, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4, decoder_attention_heads=4,
             encoder_ffn_dim=1024, decoder_ffn_dim=1024)


def workload(name: str) -> tuple[torch.nn.Module, dict]:
    """(model, generate's inputs) for one family."""
    torch.manual_seed(0)
    tokens = lambda batch, length: {"input_ids": torch.randint(4, 2000, (batch, length))}
    if name == "bart":
        config = transformers.BartConfig(vocab_size=2000, max_position_embeddings=256, **SMALL)
        return transformers.BartForConditionalGeneration(config), tokens(16, 96)
    if name == "t5":
        config = transformers.T5Config(vocab_size=2000, d_model=256, d_kv=32, d_ff=1024, num_layers=3,
                                       num_decoder_layers=3, num_heads=8, decoder_start_token_id=0)
        return transformers.T5ForConditionalGeneration(config), tokens(8, 64)
    if name == "marian":
        config = transformers.MarianConfig(vocab_size=2000, decoder_start_token_id=1, pad_token_id=1,
                                           max_position_embeddings=256, **SMALL)
        return transformers.MarianMTModel(config), tokens(8, 64)
    if name == "whisper":
        config = transformers.WhisperConfig(vocab_size=2000, num_mel_bins=80, max_source_positions=200,
                                            max_target_positions=64, decoder_start_token_id=1, pad_token_id=0,
                                            eos_token_id=2, bos_token_id=1, begin_suppress_tokens=None,
                                            suppress_tokens=None, **SMALL)
        return transformers.WhisperForConditionalGeneration(config), {"input_features": torch.randn(4, 80, 400)}
    if name == "qwen2":
        config = transformers.Qwen2Config(vocab_size=2000, hidden_size=256, intermediate_size=768, num_hidden_layers=3,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
        return transformers.Qwen2ForCausalLM(config), tokens(8, 48)
    raise SystemExit(f"unknown model {name!r}")


def generate(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(**inputs, max_new_tokens=8, min_new_tokens=8, do_sample=False, num_beams=1)


def timed(models: dict[str, torch.nn.Module], inputs: dict, rounds: int = 9) -> dict[str, float]:
    """Each model's speedup over "fp32" on whole generations: the median of per-round ratios, rotating order."""
    for model in models.values():
        generate(model, inputs)
    names, samples = list(models), {name: [] for name in models}
    for index in range(rounds):
        for name in names[index % len(names):] + names[:index % len(names)]:
            started = time.perf_counter()
            generate(models[name], inputs)
            samples[name].append(time.perf_counter() - started)
    return {name: statistics.median(f / s for f, s in zip(samples["fp32"], samples[name])) for name in names}


def row(name: str, folder: Path) -> str:
    model, inputs = workload(name)
    model.eval()
    reference_model = copy.deepcopy(model)
    reference = generate(reference_model, inputs)
    agreement = lambda m: (generate(m, inputs) == reference).float().mean().item()
    config = TuningConfig(config_set=MixedPrecisionConfig(dtype=["int8", "bf16", "fp32"]), tolerable_loss=0.01,
                          max_trials=10, storage=f"sqlite:///{folder / name}.db",
                          compile_cache=str(folder / "compiled"))
    started = time.monotonic()
    result = autotune(model, config, agreement)
    wall = time.monotonic() - started
    encoder = [n for n in result.plan if "encoder" in n and "encoder_attn" not in n and "EncDecAttention" not in n]
    dynamic = torch.ao.quantization.quantize_dynamic(copy.deepcopy(reference_model), {torch.nn.Linear})
    speedup = timed({"fp32": reference_model, "autotune": result.model, "qd": dynamic}, inputs)
    lowered = sum(result.plan[n] != "fp32" for n in encoder)
    return (f"| {name} | {wall:.0f} / {result.eval_calls} | {result.engine}, {_summary(result.plan)} | "
            f"{lowered} of {len(encoder)} | {result.speedup:.2f} / {speedup['autotune']:.2f}x | "
            f"{agreement(result.model):.3f} | {speedup['qd']:.2f}x ({agreement(dynamic):.3f}) |")


def _summary(plan: dict[str, str]) -> str:
    counts = {dtype: list(plan.values()).count(dtype) for dtype in sorted(set(plan.values()))}
    return " ".join(f"{dtype}×{count}" for dtype, count in counts.items())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bart,t5,marian,whisper,qwen2")
    args = parser.parse_args()
    print("| model | wall s / calls | engine, plan | encoder modules lowered | reported / measured | agreement "
          "| quantize_dynamic (agreement) |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            print(row(name, Path(folder)), flush=True)


if __name__ == "__main__":
    main()
