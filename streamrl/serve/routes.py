"""The routes of the OpenAI-compatible API (``openai_api.py`` holds the :class:`Endpoint` they
ask): ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
``POST /v1/feedback``, an agent's ``POST /v1/streamrl/rollouts/{id}/finish`` and ``GET
/v1/serve/stats``; every error in OpenAI's shape, the cheap refusals first."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from streamrl.chat import content_as_text
from streamrl.chat.messages import MessageError
from streamrl.serve.admission import FEEDBACK_BODY_BYTES
from streamrl.serve.contained import RETRY_AFTER_S, Contained
from streamrl.serve.openai_api import Endpoint
from streamrl.serve.request_bodies import APIError, ChatRequest, CompletionRequest, Feedback, read_body
from streamrl.serve.responses import Turn, respond
from streamrl.serve.feedback_refusals import STOPPING
from streamrl.serve.trajectories import ROLLOUT_HEADER, RolloutFinished, RolloutLimit


def make_app(endpoint: Endpoint) -> FastAPI:
    """The FastAPI application of ``endpoint``."""
    app = FastAPI(title="streamrl", docs_url=None, redoc_url=None, openapi_url=None)
    refusals = endpoint.refusals

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError):
        # counted, each kind apart (a 429 is counted where it is decided: ``refused``); logged a
        # few lines at a time
        if exc.status >= 500:
            endpoint.traffic.count("server_errors")
        elif exc.status != 429:
            endpoint.traffic.count("invalid")
        refusals.say(f"{request.method} {request.url.path} -> {exc.status} {exc.message}")
        return exc.response()

    app.add_middleware(Contained, endpoint=endpoint)

    @app.exception_handler(404)
    async def not_found(request: Request, exc):
        return APIError(404, f"Unknown path {request.method} {request.url.path}.", code="not_found").response()

    @app.exception_handler(405)
    async def wrong_method(request: Request, exc):
        return APIError(405, f"{request.method} is not allowed on {request.url.path}.").response()

    @app.get("/health")
    async def health():
        # (no key asked: a load balancer's probe; it says nothing but whether the API answers)
        if not endpoint.ready:
            return JSONResponse({"status": "starting"}, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request):
        endpoint.authorize(request)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": endpoint.created,
                                            "owned_by": "streamrl"} for name in list(endpoint.engines)]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        endpoint.authorize(request)
        rollout = request.headers.get(ROLLOUT_HEADER)
        with endpoint.admission() as room:
            req = await read_body(request, ChatRequest, endpoint.config, room)
            if req.top_logprobs:
                raise APIError(400, "top_logprobs is not served (only the sampled token's log-prob).",
                               param="top_logprobs")
            messages = endpoint.messages(req)
            problem = req.tool_choice_problem()
            if problem is not None:
                raise APIError(400, problem, param="tool_choice")
            tools = req.tool_list()
            # everything the template writes counts, not the contents alone: a tool call's arguments
            # or a tool's schema of megabytes is refused as fast as a content of as many characters;
            # and each message as at least one token, however empty (thousands of them are refused
            # before the template writes them all out, or the walk below reads them)
            endpoint.check_characters(sum(len(m["content"]) + sum(len(json.dumps(v)) for k, v in m.items()
                                                                  if k not in ("content", "role")) for m in messages)
                                      + (len(json.dumps(tools)) if tools else 0), "messages", len(messages))
            control = content_as_text.control_outside_content(endpoint.tokenizer, messages, tools)
            if control is not None:  # (the template would write it as the control token itself)
                raise APIError(400, f"Invalid value for '{control[0]}': it holds {control[1]!r}, a control token of "
                                    "this model; only a message's content may hold one (as text).", param=control[0])
            if rollout is None:
                endpoint.served(req.model)  # (the cheap refusals first: 404, 400s, 429)
                endpoint.params(req, None)
                try:
                    ids = await endpoint.off_loop(endpoint.chat_prompt, messages, tools)
                except MessageError as e:
                    raise APIError(400, str(e), param=e.param) from None
            else:
                endpoint.check_rollout(request)
                if req.n != 1:
                    raise APIError(400, "A rollout's call asks for one reply (n = 1); a group is several rollouts.",
                                   param="n")
                if req.temperature == 0:  # a greedy reply is not a sample of the policy: it cannot be trained
                    raise APIError(400, "A rollout's call samples from the policy: temperature 0 (greedy) is not "
                                        "served to rollouts; omit temperature.", param="temperature")
                try:
                    ids, segment = await endpoint.off_loop(endpoint.trajectories.prompt, rollout, messages, tools)
                except MessageError as e:
                    raise APIError(400, str(e), param=e.param) from None
                except RolloutLimit as e:
                    raise APIError(400, str(e)[0].upper() + str(e)[1:] + ".", code="rollout_limit") from None
                except RolloutFinished as e:
                    raise APIError(409, str(e)[0].upper() + str(e)[1:] + ".", code="rollout_finished") from None
                except ValueError as e:  # (the template or tokenizer refused these messages: not the rollout's state)
                    raise APIError(400, f"The messages could not be rendered as a prompt: {str(e)[:300]}",
                                   param="messages") from None
        if rollout is None:
            return await respond(endpoint, request, req, ids, chat=True)
        turn = Turn(rollout, segment, messages, ids)
        try:
            return await respond(endpoint, request, req, ids, chat=True, turn=turn)
        except BaseException:
            if not turn.done:
                endpoint.trajectories.abandon(rollout, segment)
            raise

    @app.post("/v1/completions")
    async def completions(request: Request):
        endpoint.authorize(request)
        with endpoint.admission() as room:
            req = await read_body(request, CompletionRequest, endpoint.config, room)
            if req.logprobs:
                raise APIError(400, "logprobs above 0 (top alternatives) is not served; the sampled tokens' "
                                    "log-probs are in the response's 'streamrl' object.", param="logprobs")
            if req.echo:
                raise APIError(400, "echo is not served.", param="echo")
            if isinstance(req.prompt, str):
                endpoint.check_characters(len(req.prompt), "prompt")
            endpoint.served(req.model)  # (the cheap refusals first: 404, 400s, 429)
            endpoint.params(req, None)
            ids = await endpoint.off_loop(endpoint.completion_prompt, req)
        return await respond(endpoint, request, req, ids, chat=False)

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        endpoint.authorize(request)
        if endpoint.config.reward == "recipe":  # (it would be taken and never used)
            raise APIError(400, "This endpoint scores its completions with the recipe's reward (serve.reward = "
                                "\"recipe\"); it takes no feedback.", code="feedback_not_taken")
        # (a feedback is a few hundred bytes: a body of megabytes is not one. Not charged to the
        # room for completion bodies: slow uploads that filled it made every feedback a 429 too,
        # and 4 KB a connection, the connections bounded, holds little)
        fb = await read_body(request, Feedback, endpoint.config, None, limit=FEEDBACK_BODY_BYTES)
        if abs(fb.reward) > endpoint.reward_limit:
            raise APIError(400, f"Invalid value for 'reward': {fb.reward:g} is past this run's reward.limit; rewards "
                                f"must lie within [-{endpoint.reward_limit:g}, {endpoint.reward_limit:g}].", param="reward")
        if fb.session is not None:
            reached, problem = endpoint.traffic.session_feedback(fb.session, fb.reward)
            if problem is not None:
                raise refused_feedback(problem, "session")
            return {"object": "feedback", "session": fb.session, "accepted": True, "completions": reached}
        problem = endpoint.traffic.feedback(fb.id, fb.index, fb.reward)
        if problem is not None:  # (the field it is about: the traffic store says, the id unless told)
            raise refused_feedback(problem, getattr(problem, "field", "id"))
        return {"object": "feedback", "id": fb.id, "accepted": True}

    @app.post("/v1/streamrl/rollouts/{rollout}/finish")
    async def finish_rollout(rollout: str, request: Request):
        endpoint.authorize(request)
        endpoint.check_rollout(request)
        # (off the loop: decoding every segment of a long rollout; and a JSONResponse, not
        # FastAPI's encoder, which walks every token id in Python)
        try:
            trajectory = await endpoint.off_loop(endpoint.trajectories.finish, rollout)
        except RolloutFinished as e:  # (dropped, or handed over and no longer kept): not an empty one
            raise APIError(409, str(e)[0].upper() + str(e)[1:] + ".", code="rollout_finished") from None
        return JSONResponse({"object": "streamrl.rollout", "id": rollout, "worker": endpoint.worker, **trajectory})

    @app.get("/v1/serve/stats")
    async def stats(request: Request):
        endpoint.authorize(request)
        return {"object": "serve.stats", "pending": endpoint.pending, "policy_version": endpoint.engine.version,
                "rollouts_in_flight": endpoint.trajectories.in_flight(),
                "rollouts_dropped_stale": endpoint.trajectories.dropped_stale, **endpoint.traffic.snapshot(),
                "host": endpoint.host_counts()}

    return app


def refused_feedback(problem: str, param: str) -> APIError:
    """The error for feedback the traffic store refused (``problem``: its words): 404 for an
    unknown completion or session, 503 once the run is stopping (nothing sent now is trained),
    400 otherwise."""
    text = problem[0].upper() + problem[1:] + "."
    if problem == STOPPING:
        return APIError(503, text, code="stopping", kind="server_error")
    return APIError(404 if problem.startswith("no completion") else 400, text, param=param)
