"""loraserve's runner: `LLM.generate` with every adapter added, continuous batching."""

from __future__ import annotations

from benchmarks.peers.job import Generate, Job, JobWorkload, run_job


def setup(job: Job) -> tuple[Generate, str]:
    from importlib.metadata import version

    from loraserve import LLM, SamplingParams

    llm = LLM(
        job.model,
        dtype=job.dtype,
        max_num_seqs=job.max_num_seqs,
        max_loras=max(1, min(len(job.adapters), job.max_num_seqs)),
        max_lora_rank=job.max_lora_rank,
    )
    for name, path in job.adapters.items():
        llm.add_adapter(name, path)

    def generate(workload: JobWorkload) -> list[list[int]]:
        llm.reset_prefix_cache()  # every timed run computes its prompts, as the first one did
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in workload.output_lens]
        outputs = llm.generate(workload.prompts, params, adapters=workload.adapters, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    return generate, version("loraserve")


if __name__ == "__main__":
    run_job(setup)
