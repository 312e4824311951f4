"""Provider adapters: pure outcome mapping (`outcome`), the allowlisting HTTP side (`http`), one
module per protocol (`resend`, `sms`) and the channel -> provider table (`registry`)."""
