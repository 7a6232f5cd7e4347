"""VeRL boundary: registers `actor_rollout_ref.rollout.name=pat` (register.py), converts verl's rollout config
once (config.py), and provides the replica (replica.py), its Ray server actor (server.py), the trainer-side
ServerAdapter (rollout.py), PAT's metrics for the legacy (agent_loop.py) and v1 (replay_buffer.py) trainers, and a
CPU platform for verl's trainer (cpu_platform.py, only with VERL_PLATFORM=cpu). The only package that imports
verl or omegaconf; nothing here is imported by the engine, planner or driver layers. Import this package's
modules lazily: register.py must stay cheap."""
