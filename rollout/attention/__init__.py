"""Paged attention: the function registered with transformers (`interface`) and the backends, each owning
its metadata, builder and attend (`backends/`)."""
