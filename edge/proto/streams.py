"""What both ends of a cut Generate stream agree on: the request that continues it.

The fleet's ingress resumes a stream cut by a replica's death on another replica, and the
edge client resumes one cut by its ingress's (or verifier's) loss through another; both
send the prompt plus the tokens already streamed, for the tokens still owed. A reply may
carry several tokens (`GenerateRequest.batch_tokens`): both ends count tokens with
`reply_tokens`, never replies.
"""

from __future__ import annotations

from fedge.edge.proto import verifier_pb2 as pb


def reply_tokens(reply: pb.GenerateReply) -> list[int]:
    """The tokens one Generate reply carries, in order: `token_id`, then `more_token_ids`."""
    return [int(reply.token_id), *reply.more_token_ids]


def resume_generate(request: pb.GenerateRequest, streamed: list[int]) -> pb.GenerateRequest | None:
    """The Generate request that continues after `streamed` tokens; None when none remain."""
    remaining = request.max_new_tokens - len(streamed)
    stopped = request.HasField("stop_token_id") and streamed[-1:] == [request.stop_token_id]
    if stopped or remaining <= 0:
        return None
    resumed = pb.GenerateRequest()
    resumed.CopyFrom(request)
    del resumed.prompt_ids[:]
    resumed.prompt_ids.extend([*request.prompt_ids, *streamed])
    resumed.max_new_tokens = remaining
    return resumed
