"""The gateway (`pdserve router`): an OpenAI-compatible front over the registry's prefill
and decode nodes. It tokenizes once, picks a prefill node (prefix- and load-aware) and a
decode node (load-aware), sends both legs of the request concurrently with one random
`bootstrap_room`, and streams the decode leg back (docs/architecture.md: Request lifecycles)."""
