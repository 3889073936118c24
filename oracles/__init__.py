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
  llada2         LLaDA2.x (llada2_moe): the eager MoE network from HF tensors; LLaDA2MoeModelLM.generate (greedy)
  llada_moe      LLaDA-MoE-7B-A1B: the eager MoE network from HF tensors, bidirectional
  fast_dllm_v2   Fast-dLLM v2 as transformers' Qwen2 (block-causal, Dream's shift); batch_sample for one row
  joint_threshold  SGLang's JointThreshold (LLaDA2.1 token editing) and JointThresholdInDel (LLaDA2.2)
  field_caches   the field's approximate caches on LLaDA, per row: dLLM-Cache, dKV-Cache-Decode, d2Cache, dInfer's
                 vicinity refresh (with an eager per-layer LLaDA network)
"""
