{{/*
The webhook's TLS material for tls.mode selfSigned, made once per render and shared by the
Secret (tls.yaml) and the five caBundles: the Secret already in the cluster when there is one
(an upgrade keeps the CA the apiserver trusts), else a new ECDSA P-256 CA and a serving
certificate for the webhook Service signed by it. Out: .Values._meshgateTLS = {ca, crt, key}
(base64, as a Secret's data holds them).
*/}}
{{- define "meshgate.selfSigned" -}}
{{- if not (hasKey .Values "_meshgateTLS") -}}
{{- $ns := include "meshgate.namespace" . -}}
{{- $old := lookup "v1" "Secret" $ns "meshgate-webhook-tls" -}}
{{- $data := dig "data" dict $old -}}
{{- if and (hasKey $data "ca.crt") (hasKey $data "tls.crt") (hasKey $data "tls.key") -}}
{{- $_ := set .Values "_meshgateTLS" (dict "ca" (index $data "ca.crt") "crt" (index $data "tls.crt") "key" (index $data "tls.key")) -}}
{{- else -}}
{{- $host := include "meshgate.webhookHost" . -}}
{{- $ca := genCAWithKey "meshgate-webhook-ca" (int .Values.tls.caDays) (genPrivateKey "ecdsa") -}}
{{- $names := list $host (printf "%s.cluster.local" $host) (printf "meshgate-webhook.%s" $ns) -}}
{{- $cert := genSignedCertWithKey $host nil $names (int .Values.tls.certDays) $ca (genPrivateKey "ecdsa") -}}
{{- $_ := set .Values "_meshgateTLS" (dict "ca" ($ca.Cert | b64enc) "crt" ($cert.Cert | b64enc) "key" ($cert.Key | b64enc)) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* `caBundle: ...` for a webhook's clientConfig; nothing with cert-manager (its injector writes it). */}}
{{- define "meshgate.caBundle" -}}
{{- $mode := .Values.tls.mode -}}
{{- if eq $mode "selfSigned" -}}
{{- include "meshgate.selfSigned" . -}}
caBundle: {{ .Values._meshgateTLS.ca }}
{{- else if eq $mode "existingSecret" -}}
{{- if .Values.tls.caBundle -}}
caBundle: {{ .Values.tls.caBundle | b64enc }}
{{- else -}}
{{- $secret := lookup "v1" "Secret" (include "meshgate.namespace" .) (include "meshgate.tlsSecret" .) -}}
{{- $ca := dig "data" "ca.crt" "" $secret -}}
{{- if not $ca -}}
{{- fail (printf "tls.mode existingSecret: set tls.caBundle (PEM), or put ca.crt in the Secret %s (helm template cannot read it)" (include "meshgate.tlsSecret" .)) -}}
{{- end -}}
caBundle: {{ $ca }}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The CA injector's annotation on both webhook configurations with tls.mode certManager. */}}
{{- define "meshgate.caInjection" -}}
{{- if eq .Values.tls.mode "certManager" -}}
annotations:
  cert-manager.io/inject-ca-from: {{ include "meshgate.namespace" . }}/meshgate-webhook
{{- end -}}
{{- end -}}
