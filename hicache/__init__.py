"""hicache: a hierarchical KV-cache transfer scheduler for LLM inference engines.

The engine's KV pool is L1; hicache adds a pinned host tier (L2) and a storage tier (L3) and
streams loads layer by layer so the forward pass overlaps the copy. See docs/design.md.
"""

__version__ = "0.1.0"
