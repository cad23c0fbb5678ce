"""VARIANTS for looplab's own copy of the exported code (looplab.remote_code.modeling_looplab imported as part of
looplab: `convert.load_remote_code(trust_remote_code=False)`): each variant's export code is taken from its registered
class's `export_source`, never from a folder (export_sources.RegisteredVariants). Never copied into a folder:
`convert to-hf` writes each folder its own table of the files it ships (export_sources.table_source)."""

from looplab.remote_code.export_sources import RegisteredVariants

VARIANTS = RegisteredVariants()
