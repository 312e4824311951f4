"""The bucket gate: pure token-bucket maths (`token_bucket`), its Redis Lua twin (`gate.lua`,
`gate`), and the operator-set limits (`limits`)."""
