"""Topics as code: pure definitions and plans (`spec`) and the AdminClient that applies them (`admin`)."""
