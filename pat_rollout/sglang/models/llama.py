"""Registers SGLang's own LlamaForCausalLM (unchanged)."""

from sglang.srt.models.llama import LlamaForCausalLM

EntryClass = LlamaForCausalLM
