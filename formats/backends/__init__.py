"""The built-in backends (``safetensors``, ``zarr``), each in its own module, imported on first use by
:func:`moeckpt.formats.backend.get_backend`; :mod:`.base` holds what backends share."""
