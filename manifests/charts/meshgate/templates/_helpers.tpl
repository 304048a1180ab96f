{{/*
The names every template shares. meshgate's objects live in .Values.namespace, which the
chart creates and `helm uninstall` deletes; the release itself is stored elsewhere
(docs/operations.md, "Install"): a release stored in the namespace it deletes loses its own
record half-way through the uninstall, and the cleanup hook could not start there.
*/}}
{{- define "meshgate.namespace" -}}
{{- if eq .Values.namespace .Release.Namespace -}}
{{- fail (printf "install the release into another namespace than %q (e.g. `helm install meshgate manifests/charts/meshgate -n kube-system`): the chart creates and deletes %q itself, and `helm uninstall` could not finish in a namespace it is deleting" .Values.namespace .Values.namespace) -}}
{{- end -}}
{{- .Values.namespace -}}
{{- end -}}

{{/* The image both workloads run: repository:tag@digest, or repository:tag without a digest. */}}
{{- define "meshgate.image" -}}
{{- $i := .Values.image -}}
{{- if $i.digest -}}
{{- printf "%s:%s@%s" $i.repository $i.tag $i.digest -}}
{{- else -}}
{{- printf "%s:%s" $i.repository $i.tag -}}
{{- end -}}
{{- end -}}

{{/* The agent's ServiceAccount as the apiserver names it in admission requests. */}}
{{- define "meshgate.agentUser" -}}
{{- printf "system:serviceaccount:%s:meshgate-agent" (include "meshgate.namespace" .) -}}
{{- end -}}

{{/* The webhook Service's DNS names, which its serving certificate must carry. */}}
{{- define "meshgate.webhookHost" -}}
{{- printf "meshgate-webhook.%s.svc" (include "meshgate.namespace" .) -}}
{{- end -}}

{{/* The Secret the webhook serves from: its own, or the one tls.existingSecret names. */}}
{{- define "meshgate.tlsSecret" -}}
{{- if eq .Values.tls.mode "existingSecret" -}}
{{- required "tls.mode existingSecret needs tls.secretName" .Values.tls.secretName -}}
{{- else -}}
meshgate-webhook-tls
{{- end -}}
{{- end -}}

{{/* A duration of whole seconds, minutes or hours ("90s", "3m", "1h") in seconds. */}}
{{- define "meshgate.seconds" -}}
{{- $d := toString . -}}
{{- if not (regexMatch "^[0-9]+[smh]$" $d) -}}
{{- fail (printf "want a duration like 90s, 3m or 1h, got %q" $d) -}}
{{- end -}}
{{- $n := int (trimSuffix "s" (trimSuffix "m" (trimSuffix "h" $d))) -}}
{{- if hasSuffix "h" $d -}}{{ mul $n 3600 }}{{- else if hasSuffix "m" $d -}}{{ mul $n 60 }}{{- else -}}{{ $n }}{{- end -}}
{{- end -}}

{{/*
The extra MESHGATE_* settings of agent.env / webhook.env as ConfigMap entries. In: (list ENV
VALUE_PATH KEY...), KEY... being the ones the chart sets from named values, which ENV may not
repeat (a ConfigMap cannot hold a key twice; set the named value instead).
*/}}
{{- define "meshgate.extraEnv" -}}
{{- $env := index . 0 -}}
{{- $path := index . 1 -}}
{{- $named := slice . 2 -}}
{{- range $k, $v := $env -}}
{{- if has $k $named -}}
{{- fail (printf "%s.%s: the chart sets %s from its own value (values.yaml); set that instead" $path $k $k) -}}
{{- end }}
{{ $k }}: {{ $v | toString | quote }}
{{- end -}}
{{- end -}}

{{/*
Istio ambient (ambient.enabled): the profiles both components run, the settings the chart
then owns (a JSON list, for meshgate.extraEnv), and the agent's node proxy socket directory.
*/}}
{{- define "meshgate.ambientProfiles" -}}
istio-ambient,istio
{{- end -}}
{{- define "meshgate.ambientReserved" -}}
{{- if .Values.ambient.enabled -}}
["MESHGATE_PROFILES"]
{{- else -}}
[]
{{- end -}}
{{- end -}}
{{- define "meshgate.nodeProxySocketDir" -}}
{{- if .Values.agent.nodeProxySocketDir -}}
{{ .Values.agent.nodeProxySocketDir }}
{{- else if .Values.ambient.enabled -}}
/var/run/ztunnel
{{- end -}}
{{- end -}}

{{/*
Tolerations of meshgate's taint: the chart's taintKey, and the keys meshgate used before
(releases before --taint-key, and the default when taintKey is another), still on nodes until
their agent is upgraded and removes them.
*/}}
{{- define "meshgate.taintTolerations" -}}
- key: {{ .Values.taintKey }}
  operator: Exists
{{- range without (list "readiness.k8s.io/meshgate-cni-unverified" "meshgate.io/cni-unverified") .Values.taintKey }}
- key: {{ . }}
  operator: Exists
{{- end }}
{{- end -}}

{{/*
The NodeReadinessRule's name. The controller refuses a change of enforcementMode, taint.key or
taint.effect on a live rule (422), so the name carries a hash of the three: a `helm upgrade`
that changes one creates a rule of another name and deletes the old one instead of patching it
(docs/operations.md, "With the node-readiness-controller", says what that deletion does).
*/}}
{{- define "meshgate.nodeReadinessRuleName" -}}
{{- $immutable := printf "%s|%s|%s" .Values.taintKey .Values.taintEffect .Values.nodeReadinessRule.enforcementMode -}}
meshgate-cni-verified-{{ sha256sum $immutable | trunc 8 }}
{{- end -}}

{{/*
agent.impersonateNode resolved: "true" when the agent acts as its node (Constrained
Impersonation; agent-clusterrole-impersonation.yaml and MESHGATE_IMPERSONATE_NODE), "" for
the cluster-wide read grants of rbac.yaml. `auto` goes by the apiserver's version, the one
thing Helm sees of the cluster that tells: the ConstrainedImpersonation gate is on by default
from 1.36 (alpha, off by default, in 1.35). Feature gates are no API object, so neither
.Capabilities nor `lookup` can see a gate turned on (or off) by hand: set true or false then.
*/}}
{{- define "meshgate.impersonateNode" -}}
{{- $v := .Values.agent.impersonateNode -}}
{{- if eq (toString $v) "auto" -}}
{{- if semverCompare ">=1.36.0-0" .Capabilities.KubeVersion.Version -}}true{{- end -}}
{{- else if $v -}}
true
{{- end -}}
{{- end -}}

{{/*
The API version of the MutatingAdmissionPolicy meshgate-placement-affinity, or "" when it is not
rendered (values.yaml placementAffinity). Only in modes enforce and condition-only: report mode
keeps nothing off a Node. `auto` renders it where the apiserver serves the kind, as discovery
tells Helm (`helm template` sees only what `--api-versions` names): v1 from 1.36, v1beta1 on
1.34-1.35 with the MutatingAdmissionPolicy gate and admissionregistration.k8s.io/v1beta1 on.
*/}}
{{- define "meshgate.placementAffinityApi" -}}
{{- $want := toString .Values.placementAffinity -}}
{{- if not (has $want (list "auto" "true" "false")) -}}
{{- fail (printf "placementAffinity must be auto, true or false, not %q" $want) -}}
{{- end -}}
{{- if and (ne .Values.mode "report") (ne $want "false") -}}
{{- if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1/MutatingAdmissionPolicy" -}}
admissionregistration.k8s.io/v1
{{- else if .Capabilities.APIVersions.Has "admissionregistration.k8s.io/v1beta1/MutatingAdmissionPolicy" -}}
admissionregistration.k8s.io/v1beta1
{{- else if eq $want "true" -}}
{{- fail "placementAffinity is true, but the apiserver serves no MutatingAdmissionPolicy (1.36+, or 1.34-1.35 with the MutatingAdmissionPolicy feature gate and --runtime-config=admissionregistration.k8s.io/v1beta1=true)" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
The binding entry's failurePolicy. Ignore where an outage can admit nothing the webhook would
refuse that the apiserver does not refuse itself: in enforce mode with
meshgate-placement-affinity rendered (the scheduler keeps meshed pods that tolerate the taint
off gated Nodes, the taint keeps the others off), and in report mode (which refuses nothing).
Fail otherwise: in condition-only mode the taint is another controller's and may come after a
new Node is schedulable.
*/}}
{{- define "meshgate.bindingsFailurePolicy" -}}
{{- if or (eq .Values.mode "report") (and (eq .Values.mode "enforce") (include "meshgate.placementAffinityApi" .)) -}}
Ignore
{{- else -}}
Fail
{{- end -}}
{{- end -}}
