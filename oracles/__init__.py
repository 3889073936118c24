"""Independent references for the tests and benchmarks: eager PyTorch transcriptions of the authors' code (their
generation loops, rules and likelihood estimators) and transformers' own model classes under each family's mask.

Never installed and never imported by the library (`python3 ../shared/hooks/layering.py .` checks): they share no
code with `localleap_jax`, so a test that compares the two can fail.

  bidirectional  LLaDA as transformers' Llama and Dream as its Qwen2 under a bidirectional mask; LLaDA's generate
  rules          every decoding rule's published form, one step at a time
  sdar           SDAR as transformers' Qwen3 under the block-causal mask; SDAR's block_diffusion_generate
  fast_dllm      Fast-dLLM's three loops (no cache, prefix cache, dual cache)
  revoke         WINO, Saber and Saber's ReMDM loop
  likelihood     LLaDA's and Dream's likelihood estimators
"""
