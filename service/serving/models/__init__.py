"""The models served in this process's reach: the registry (every model's name, its head, its backbone group), loading
backbone groups, model control at runtime (Triton's repository extension), the head cache, and the local engine
client that holds them together. It takes what it uses (settings, registry, metrics), never the app's state."""
