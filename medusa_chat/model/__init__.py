"""The model: where it comes from (sources/: registry, hub, embedded, files, loading) and how it computes
(forward/: lean, native C and CUDA forwards, the KV cache, the drafts' networks); mapped_weights serves both."""
