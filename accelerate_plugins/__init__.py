"""accelerate_plugins: part of hf-scale-plugins (see the README for what it provides)."""

__all__: list[str] = []
