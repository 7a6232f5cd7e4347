"""SGLang model registry subset for pat_rollout (set as SGLANG_EXTERNAL_MODEL_PACKAGE).

SGLang imports every module under `sglang.srt.models` at start-up (~30 s of CPU per process on this
machine); pointing SGLANG_EXTERNAL_MODEL_PACKAGE here registers only the architectures pat_rollout serves.
Each module exposes `EntryClass` like SGLang's own model files. Imported only by SGLang's processes.
"""
