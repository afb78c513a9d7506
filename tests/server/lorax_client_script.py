"""Run by the lorax-client virtual environment (never by ours): drive the server, print JSON results.

Usage: python lorax_client_script.py URL ADAPTER PROMPT MAX_NEW_TOKENS
"""

import json
import sys

from lorax import Client

url, adapter, prompt, max_new_tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
client = Client(url)
response = client.generate(prompt, adapter_id=adapter, max_new_tokens=max_new_tokens, details=True)
events = list(client.generate_stream(prompt, adapter_id=adapter, max_new_tokens=max_new_tokens))
base = client.generate(prompt, max_new_tokens=max_new_tokens)
print(
    json.dumps(
        {
            "generated_text": response.generated_text,
            "finish_reason": response.details.finish_reason.value,
            "generated_tokens": response.details.generated_tokens,
            "token_ids": [token.id for token in response.details.tokens],
            "stream_texts": [event.token.text for event in events],
            "stream_final": events[-1].generated_text,
            "stream_details": events[-1].details.generated_tokens,
            "base_text": base.generated_text,
        }
    )
)
