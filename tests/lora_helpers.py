"""PEFT adapters the LoRA tests create, and the tokens PEFT's merged model generates with them."""

from __future__ import annotations

from pathlib import Path

import peft
import torch
from transformers import AutoModelForCausalLM

ALL_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_model(model_dir: Path):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_adapter(model_dir: Path, path: Path, rank: int, modules: list[str], seed: int, scale: float = 0.05) -> None:
    """A PEFT adapter with random A and non-zero random B (``scale`` x normal), by default small enough that the
    model stays fluent-ish."""
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False)
    model = peft.get_peft_model(base_model(model_dir), config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * scale)
    model.save_pretrained(path)


def greedy(model, prompt_ids: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``model``'s greedy continuation of each prompt, ``new_tokens`` long."""
    outs = []
    for ids in prompt_ids:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        outs.append(gen[0, len(ids) :].tolist())
    return outs


def merged_model(model_dir: Path, adapter_dir: Path | None):
    """PEFT's merged model (the base model where ``adapter_dir`` is None)."""
    model = base_model(model_dir)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir).merge_and_unload().eval()
    return model


def merged_greedy(model_dir: Path, adapter_dir: Path | None, prompt_ids: list[list[int]], new_tokens: int):
    """PEFT's merged model's greedy tokens per prompt (the base model's where ``adapter_dir`` is None)."""
    return greedy(merged_model(model_dir, adapter_dir), prompt_ids, new_tokens)


def token_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    """``model``'s log-probability of each of ``tokens`` following ``prompt`` (one forward pass, float32)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    return logits.log_softmax(-1).gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()
