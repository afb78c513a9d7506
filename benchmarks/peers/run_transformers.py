"""transformers + peft's runner: one static batch per workload; peft's mixed-adapter batch
(`generate(..., adapter_names=...)`) when any request names an adapter, plain transformers
`generate` when none does. `options.unpadded` runs the requests one at a time instead (the
agreement check's reference: left padding changes float32 results in the last bits)."""

from __future__ import annotations

from benchmarks.peers.job import Generate, Job, JobWorkload, run_job


def without_eos(model):
    """EOS ignored as the other systems ignore it: no stop, and (unlike `min_new_tokens`, which
    forbids EOS) the EOS token may still be the greedy choice, so greedy tokens stay comparable."""
    model.generation_config.eos_token_id = None
    return model


def setup(job: Job) -> tuple[Generate, str]:
    import peft
    import torch
    import transformers
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = getattr(torch, job.dtype)
    tokenizer = AutoTokenizer.from_pretrained(job.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    base = without_eos(AutoModelForCausalLM.from_pretrained(job.model, dtype=dtype).eval())
    adapted = None
    if job.adapters:
        adapted = without_eos(AutoModelForCausalLM.from_pretrained(job.model, dtype=dtype))
        (first, first_path), *rest = job.adapters.items()
        adapted = PeftModel.from_pretrained(adapted, first_path, adapter_name=first)
        for name, path in rest:
            adapted.load_adapter(path, adapter_name=name)
        adapted.eval()

    def generate(workload: JobWorkload) -> list[list[int]]:
        if job.options.get("unpadded") and len(workload.prompts) > 1:
            # The exact reference: one request at a time, so no padding changes the numbers.
            return [generate(JobWorkload(workload.name, [p], [n], [a]))[0] for p, n, a in zip(
                workload.prompts, workload.output_lens, workload.adapters, strict=True
            )]  # fmt: skip
        width = max(map(len, workload.prompts))
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in workload.prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in workload.prompts])
        longest = max(workload.output_lens)
        kwargs = {}
        model = base
        if any(a is not None for a in workload.adapters):
            model = adapted
            kwargs["adapter_names"] = [a if a is not None else "__base__" for a in workload.adapters]
        with torch.inference_mode():
            out = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad,
                **kwargs,
            )
        return [row[width : width + n].tolist() for row, n in zip(out, workload.output_lens, strict=True)]

    return generate, f"transformers {transformers.__version__}, peft {peft.__version__}"


if __name__ == "__main__":
    run_job(setup)
