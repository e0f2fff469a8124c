"""OpenAI-compatible HTTP server: `app` (routes), `protocol` (request bodies), `serving_*` (endpoint logic),
`launch` (`pagellm serve`)."""
