"""HuggingFace transformers reference outputs shared by the engine and pool tests (tests/ is on sys.path
through the root conftest)."""

from __future__ import annotations

import torch

from pat_rollout.types import Request


def hf_greedy(model_path: str, requests: list[Request]) -> list[tuple[list[int], list[float]]]:
    """HF transformers generate(do_sample=False) in float64, one prompt at a time (no padding):
    (tokens, log_softmax of the raw logits at each chosen token)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()
    out = []
    for r in requests:
        ids = torch.tensor([r.prompt_token_ids])
        with torch.no_grad():
            res = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=r.sampling.max_new_tokens, output_logits=True,
                                 return_dict_in_generate=True)
        tokens = res.sequences[0, ids.shape[1]:].tolist()
        log_probs = [torch.log_softmax(lg[0], -1)[t].item() for lg, t in zip(res.logits, tokens)]
        out.append((tokens, log_probs))
    return out
