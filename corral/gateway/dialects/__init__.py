"""Wire dialects over the turn pipeline: each translates its API's requests into
:class:`~corral.gateway.turns.TurnRequest` s and the pipeline's results and events back into its
own bodies and server-sent events. None of them knows the engine, the template or the
recording."""
