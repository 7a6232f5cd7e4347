"""VeRL boundary: registers `actor_rollout_ref.rollout.name=pat` (register.py), converts verl's rollout config
once (config.py), and provides the replica (replica.py), its Ray server actor (server.py) and the trainer-side
ServerAdapter (rollout.py). The only package that imports verl or omegaconf; nothing here is imported by the
engine, planner or driver layers. Import this package's modules lazily: register.py must stay cheap."""
