"""Checkpoint directories: written atomically, opened once, restored onto one device or straight into a mesh's shards.

A checkpoint directory holds
  config.json      the model's config (the HF one, copied, or one this project wrote); names the family
  params/          the Flax parameter tree, saved with Orbax
  tokenizer files  tokenizer.json, tokenizer_config.json, ... (copied verbatim)
  manifest.json    format tag, source, per-shard sha256, parameter dtype, and the content hash of
                   every file under params/ with their fingerprint; written last
  README.md        where it came from

  writing   atomic_directory, write_params, write_checkpoint_files, save: an interrupted write leaves nothing
  manifest  read_manifest and the content hashes of params/ (fingerprints, layout and content checks)
  reading   open_checkpoint (manifest and config read once), restore (one device or a mesh), load
  embedded  the small models shipped in the package, by the names `ll.load` takes
"""

from localleap_jax.checkpoint.embedded import EMBEDDED, EMBEDDED_CHAIN, EMBEDDED_DG, EMBEDDED_MODELS, EMBEDDED_SDAR
from localleap_jax.checkpoint.manifest import (FORMAT, PARAMS_DIGEST, check_params_content, check_params_layout,
                                               fingerprint_of, hash_params_files, params_file_records,
                                               params_fingerprint, read_manifest)
from localleap_jax.checkpoint.reading import (PARAM_DTYPES, Opened, abstract_params, count_non_finite, load,
                                              non_finite_counts, open_checkpoint, parameter_dtype, restore)
from localleap_jax.checkpoint.writing import (CHUNK_BYTES, atomic_directory, check_output_path, chunking,
                                              copy_tokenizer_files, save, write_checkpoint_files, write_params)
from localleap_jax.errors import CheckpointError
from localleap_jax.loaded import Model

__all__ = ["CHUNK_BYTES", "CheckpointError", "EMBEDDED", "EMBEDDED_CHAIN", "EMBEDDED_DG", "EMBEDDED_MODELS",
           "EMBEDDED_SDAR", "FORMAT", "Model", "Opened", "PARAMS_DIGEST", "PARAM_DTYPES", "abstract_params", "atomic_directory",
           "check_output_path", "check_params_content", "check_params_layout", "chunking", "copy_tokenizer_files",
           "count_non_finite", "fingerprint_of", "hash_params_files", "load", "non_finite_counts", "open_checkpoint",
           "parameter_dtype", "params_file_records", "params_fingerprint", "read_manifest", "restore", "save",
           "write_checkpoint_files", "write_params"]
